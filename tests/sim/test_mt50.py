"""Meta-World MT50 in LeRobot's regime (``rollout.env=mt50``): the suite as LeRobot 0.6.1's metaworld_config.json
defines it, the observation as its envs/metaworld.py makes it, the recorder's multi-task dataset in
lerobot/metaworld_mt50's layout, and a multi-task rollout whose prompt picks the task (the scripted experts, served
behind one server that reads only the prompt, must succeed as they do acting directly)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("metaworld", reason="pip install -e '.[sim]'")
pytest.importorskip("websockets.sync.client", reason="pip install -e '.[sim]'")

from slurmvla.config.rollout import RolloutConfig  # noqa: E402
from slurmvla.inference.closed_loop import groups_of, run_served, shard_seeds, summarize  # noqa: E402
from slurmvla.inference.server import PolicyServer  # noqa: E402
from slurmvla.sim.metaworld import mt50  # noqa: E402
from slurmvla.sim.metaworld.env import ACTION_DIM, DP3, ENV_STATE_KEY, IMAGE_KEY, LEROBOT, STATE_KEY, MetaWorld  # noqa: E402
from slurmvla.sim.metaworld.expert import Expert  # noqa: E402

# Three easy tasks with instructions of their own, and a hard one.
TASKS = ["reach-v3", "button-press-v3", "drawer-open-v3", "pick-place-v3"]


class PromptExpert:
    """The scripted experts of ``tasks`` behind one server: the prompt alone says whose action answers."""

    def __init__(self, tasks: list[str]):
        self.experts = {mt50.INSTRUCTIONS[t]: Expert(t) for t in tasks}

    def metadata(self) -> dict:
        return {"server": "slurmvla", "policy": "mt50_experts", "action_horizon": 1, "action_dim": ACTION_DIM,
                "cameras": {"corner2": IMAGE_KEY}, "state": [ENV_STATE_KEY], "prompt": "prompt",
                "execution_modes": ["sync", "async"]}

    def infer(self, obs: dict) -> dict:
        return {"actions": self.experts[obs["prompt"]].action(obs[ENV_STATE_KEY])[None]}


def test_the_suite_is_lerobots():
    # LeRobot's groups: 28 / 11 / 6 / 5 tasks, every Meta-World v3 task once.
    assert {g: len(t) for g, t in mt50.GROUPS.items()} == {"easy": 28, "medium": 11, "hard": 6, "very_hard": 5}
    from slurmvla.sim.metaworld.env import tasks

    assert sorted(mt50.TASKS) == tasks() and len(set(mt50.TASKS)) == 50
    # Two tasks share an instruction: lerobot/metaworld_mt50 holds 49 task strings.
    assert len(mt50.task_strings(mt50.TASKS)) == 49
    assert mt50.INSTRUCTIONS["push-v3"] == mt50.INSTRUCTIONS["push-back-v3"]
    assert mt50.suite("hard") == mt50.GROUPS["hard"] and mt50.suite(None) == mt50.TASKS
    assert mt50.suite("reach-v3, push-v3,reach-v3") == ["reach-v3", "push-v3"]
    assert mt50.group_of("assembly-v3") == "hard" and mt50.group_of("shelf-place-v3") == "very_hard"
    with pytest.raises(ValueError, match=r"rollout.task='hardest' is not an MT50 task or group; choose null .*"
                                         r"\['easy', 'medium', 'hard', 'very_hard'\]"):
        RolloutConfig(env="mt50", task="hardest")
    assert RolloutConfig(env="mt50").task is None


def test_lerobots_observation_is_the_flipped_corner2_and_four_numbers():
    """LeRobot's envs/metaworld.py: corner2 (camera 2) at [0.75, 0.075, 0.7], the frame flipped on both axes,
    ``agent_pos`` = Meta-World's first 4 numbers; the instruction its metaworld_config.json's."""
    env, plain = MetaWorld("reach-v3", 64, 64, regime=LEROBOT), MetaWorld("reach-v3", 64, 64, regime=DP3)
    try:
        assert env.env.model.camera("corner2").id == 2
        np.testing.assert_allclose(env.env.model.cam_pos[2], [0.75, 0.075, 0.7])
        env.reset(5)
        obs = env.observe()
        assert obs[STATE_KEY].shape == (4,)
        np.testing.assert_array_equal(obs[STATE_KEY], obs[ENV_STATE_KEY][:4].astype(np.float32))
        # The same camera unflipped, rendered by hand, flipped on both axes is the observation.
        plain.env.model.cam_pos[2] = LEROBOT.camera_position
        plain.reset(5)
        np.testing.assert_array_equal(obs[IMAGE_KEY], plain.render()[::-1, ::-1])
        assert env.instruction == "Reach a goal position" and plain.instruction == "reach"
    finally:
        env.close()
        plain.close()


def test_the_recorder_writes_one_dataset_of_many_tasks_in_lerobots_layout(tmp_path):
    from slurmvla.sim.record import main as record

    out = tmp_path / "mt50"
    tasks = ["reach-v3", "push-v3", "push-back-v3"]
    record(["--env", "mt50", "--task", ",".join(tasks), "--episodes", "2", "--height", "32", "--width", "32",
            "--out", str(out)])
    info = json.loads((out / "meta" / "info.json").read_text())
    # lerobot/metaworld_mt50's features (its meta/info.json), the camera a video here.
    assert info["fps"] == 80 and info["robot_type"] == "metaworld" and info["total_tasks"] == 2
    assert info["features"]["observation.image"]["dtype"] == "video"
    assert {k: info["features"][k] for k in ("observation.state", "action", "task_id")} == {
        "observation.state": {"dtype": "float32", "shape": [4], "names": {"axes": None}},
        "action": {"dtype": "float32", "shape": [4], "names": {"axes": ["x", "y", "z", "gripper"]}},
        "task_id": {"dtype": "int16", "shape": [1], "names": None}}
    import pyarrow.parquet as pq

    tasks_table = pq.read_table(out / "meta" / "tasks.parquet").to_pydict()
    assert tasks_table["task"] == ["Reach a goal position", "Push the puck to a goal"]
    frames = pq.read_table(sorted((out / "data").rglob("*.parquet"))).to_pydict()
    summary = json.loads((out / "mt50.json").read_text())
    for episode, task in enumerate(["reach-v3"] * 2 + ["push-v3"] * 2 + ["push-back-v3"] * 2):
        mine = [i for i, e in enumerate(frames["episode_index"]) if e == episode]
        assert {frames["task_index"][i] for i in mine} == {0 if task == "reach-v3" else 1}
        assert {frames["task_id"][i] for i in mine} == {mt50.TASK_IDS[task]}
        # Each episode ends at the task's first success, as LeRobot's environment ends it.
        success = [frames["next.success"][i] for i in mine]
        assert success[-1] and not any(success[:-1])
    assert summary["tasks"]["push-back-v3"]["seeds"] == [0, 1] and summary["regime"] == "lerobot"

    # The data layer trains on it: the instruction is the episode's task string.
    from slurmvla.compose import compose
    from slurmvla.data.loader import TrainData
    from slurmvla.data.mixture import Mixture
    from slurmvla.policy import policy_class
    from slurmvla.policy.tokenizer import detokenize

    cfg = compose(["experiment=mt50", f"data.root={out}", "data.num_workers=0", "data.loader=map",
                   "policy.image_size=32"])
    spec = policy_class(cfg.policy).sample_spec(cfg.policy)
    batch = next(iter(TrainData(Mixture(cfg.data, spec, 0), cfg.data, 16, 0, 1, 0).iterate(0, 0)))
    assert set(batch["instruction"]) == set(tasks_table["task"]) and batch["state"].shape[-1] == 4
    assert [detokenize(ids) for ids in batch["text"]] == list(batch["instruction"])


def test_one_server_serves_every_task_told_by_its_prompt():
    """The closed loop over a suite: (task, seed) episodes, one environment a task, each request carrying its task's
    instruction; the scripted experts behind one server, chosen by the prompt alone, succeed as they do acting on
    the environment directly, and shards split the episodes without losing or repeating one."""
    cfg = RolloutConfig(env="mt50", task=",".join(TASKS), episodes=2, max_steps=300, replan_steps=1, height=32,
                        width=32, videos=0)
    plan = shard_seeds(cfg, (0, 1))
    assert plan == [(t, 100000 + e) for t in TASKS for e in range(2)]
    halves = shard_seeds(cfg, (0, 2)) + shard_seeds(cfg, (1, 2))
    assert sorted(halves) == sorted(plan) and len(halves) == len(plan)

    direct = {}
    for task, seed in plan:
        env, expert = MetaWorld(task, 32, 32, max_steps=300, regime=LEROBOT), Expert(task)
        try:
            env.reset(seed)
            for _ in range(300):
                if env.step(expert.act(env)).success:
                    break
            direct[(task, seed)] = env.steps
        finally:
            env.close()
    served = run_served(PolicyServer(PromptExpert(TASKS), "127.0.0.1", 0), cfg, plan, None)
    assert {(e["task"], e["seed"]): e["length"] for e in served} == direct
    summary = summarize(served, 1.0, groups_of(cfg))
    assert summary["rollout/success_rate"] == 1.0 and set(summary["tasks"]) == set(TASKS)
    assert summary["groups"]["easy"]["episodes"] == 6 and summary["groups"]["hard"]["episodes"] == 2
    assert summary["rollout/group_mean_success_rate"] == 1.0
