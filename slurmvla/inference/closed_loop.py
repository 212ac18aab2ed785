"""The closed loop: a policy drives a simulated arm (:mod:`slurmvla.sim`: ``rollout.env``, the pick task, a
Meta-World task, or a simulator of one's own) through openpi's published client (``openpi_client.WebsocketClientPolicy``)
as a robot would, or, where that is not installed, the project's client of the same protocol
(:mod:`slurmvla.inference.client`), and the success rate is the metric.

Each request is the observation under the environment's client keys (openpi's DROID keys for the pick task: the
cameras and state the server's metadata names, and the prompt), each reply an action chunk, of which ``rollout.replan_steps`` actions are executed
before the next request (open loop in between, as openpi's clients do). The chunks run through
:class:`~slurmvla.inference.executor.Executor` in ``rollout.execution``'s mode, and the simulator keeps time:
an answer takes effect ``rollout.delay_steps`` control steps after its observation (or the call's measured
wall time at the environment's control rate), the environment advancing meanwhile. Per episode: success, return (the dense progress
reward, in [0, 1] per step, summed over ``rollout.max_steps`` with success absorbing: the steps after it
count 1 each), length, the action jumps at chunk switches and within chunks, the steps held;
:func:`summarize` gives the ``rollout/*`` metrics.

``python -m slurmvla.rollout`` runs it against a source or a running server; the trainer's periodic
rollouts (``trainer.rollout_every_steps``) call :func:`in_training`, which ``python -m slurmvla.train``
hands to the trainer.
"""

from __future__ import annotations

import json
import logging
import math
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np

from slurmvla.config.rollout import RolloutConfig
from slurmvla.inference.executor import Executor, switch_metrics

log = logging.getLogger("slurmvla.rollout")

# The command that installs the simulators (tests/test_packaging.py checks that it names the extra that does).
INSTALL = "pip install -e '.[sim]'"


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The 95 % Wilson score interval of a success rate (sound at 0 and n, unlike the normal one)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def summarize(episodes: list[dict], wall_s: float, groups: dict[str, list[str]] | None = None) -> dict:
    """The metrics of a set of episodes (``rollout/*``) with the episodes themselves; episodes of a suite's tasks
    (each with its ``task``) also per task (``tasks``) and per group of ``groups`` (name -> tasks:
    ``rollout/<group>/success_rate``, and ``rollout/group_mean_success_rate``, the mean of the groups' rates, as
    the MT50 table averages)."""
    n = len(episodes)
    wins = sum(e["success"] for e in episodes)
    lo, hi = wilson_interval(wins, n)
    steps = sum(e["length"] for e in episodes)
    requests = sum(e["requests"] for e in episodes)
    return {
        "rollout/success_rate": wins / max(n, 1), "rollout/success_ci95_low": lo, "rollout/success_ci95_high": hi,
        "rollout/episodes": n, "rollout/successes": wins,
        # The actions of each chunk executed (rollout.replan_steps, as resolved against the policy's horizon).
        "replan_steps": episodes[0].get("replan_steps") if episodes else None,
        "rollout/mean_return": float(np.mean([e["return"] for e in episodes])) if n else 0.0,
        "rollout/mean_length": steps / max(n, 1),
        "rollout/wall_s": wall_s, "rollout/steps_per_s": steps / max(wall_s, 1e-9),
        "rollout/requests_per_s": requests / max(wall_s, 1e-9),
        **_jumps(episodes),
        **per_task(episodes, groups or {}),
        **failures(episodes),
        "episodes": sorted(episodes, key=lambda e: (e.get("task") or "", e["seed"])),
    }


def per_task(episodes: list[dict], groups: dict[str, list[str]]) -> dict:
    """A suite's episodes by task (``tasks``: successes, episodes, rate, and the failures' diagnostics) and by
    group (``rollout/<group>/success_rate`` over the group's episodes, ``groups``: each with its interval, and
    ``rollout/group_mean_success_rate``); nothing for single-task episodes."""
    tasks: dict[str, list[dict]] = {}
    for e in episodes:
        if e.get("task") is not None:
            tasks.setdefault(e["task"], []).append(e)
    if not tasks:
        return {}
    out: dict = {"tasks": {t: {"successes": sum(e["success"] for e in mine), "episodes": len(mine),
                               "success_rate": sum(e["success"] for e in mine) / len(mine), **failures(mine)}
                           for t, mine in sorted(tasks.items())}}
    rates, table = [], {}
    for group, names in groups.items():
        mine = [e for t in names for e in tasks.get(t, [])]
        if not mine:
            continue
        wins = sum(e["success"] for e in mine)
        lo, hi = wilson_interval(wins, len(mine))
        table[group] = {"successes": wins, "episodes": len(mine), "tasks": sum(t in tasks for t in names),
                        "of_tasks": len(names), "success_rate": wins / len(mine), "ci95": [lo, hi]}
        out[f"rollout/{group}/success_rate"] = wins / len(mine)
        rates.append(wins / len(mine))
    if table:
        out["groups"] = table
        out["rollout/group_mean_success_rate"] = float(np.mean(rates))
    return out


def failures(episodes: list[dict]) -> dict:
    """How far the failed episodes got, from the environment's per-episode ``diagnostics`` (Meta-World's): of
    the failures, how many raised each flag, and each number's median; nothing for an environment without them."""
    failed = [e["diagnostics"] for e in episodes if not e["success"] and "diagnostics" in e]
    if not failed:
        return {}
    out: dict = {"episodes": len(failed)}
    for key, value in failed[0].items():
        values = [d[key] for d in failed]
        out[key] = sum(map(bool, values)) if isinstance(value, bool) else float(np.median(values))
    return {"failures": out}


def _jumps(episodes: list[dict]) -> dict:
    """The action jumps at chunk switches and within chunks over every episode's steps, and the mean steps
    held (episodes written before these were measured count as none)."""
    out = {}
    for part, count in (("switch", "switches"), ("within", "within_steps")):
        n = sum(e.get(count, 0) for e in episodes)
        out[f"rollout/{part}_jump_mean"] = sum(e.get(f"{part}_jump_mean", 0.0) * e.get(count, 0) for e in episodes) / max(n, 1)
        out[f"rollout/{part}_jump_max"] = max((e.get(f"{part}_jump_max", 0.0) for e in episodes), default=0.0)
    out["rollout/mean_hold_steps"] = sum(e.get("hold_steps", 0) for e in episodes) / max(len(episodes), 1)
    return out


def require_sim(env: str | None = None) -> None:
    """A ValueError naming the extra when the client's packages (websockets, msgpack) or, given ``env``, that
    simulator's environment cannot be imported."""
    _need("websockets.sync.client")
    _need("msgpack")
    if env is not None:
        from slurmvla.registry import SIMULATORS

        _need(SIMULATORS.get(env).target.partition(":")[0])


def _need(module: str):  # noqa: ANN202
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as e:
        raise ValueError(f"the closed loop needs {module} ({e}); {INSTALL}") from None


def client_class() -> Any:
    """openpi's client where it is installed (what a robot runs), else the project's client of its protocol."""
    try:
        from openpi_client.websocket_client_policy import WebsocketClientPolicy
    except ImportError:
        from slurmvla.inference.client import WebsocketClient

        return WebsocketClient
    return WebsocketClientPolicy


def run_episodes(client: Any, cfg: RolloutConfig, seeds: list, video_dir: Path | None = None) -> list[dict]:
    """Run one episode per seed of ``rollout.env`` against ``client`` (anything with openpi's
    ``infer(obs) -> {"actions"}`` and ``get_server_metadata()``); returns one dict per episode. ``seeds``: each an
    environment seed of ``rollout.task``, or a ``(task, seed)`` pair (:func:`shard_seeds`: a suite's tasks, one
    environment each, its episodes then carrying their ``task``); the first ``rollout.videos`` episodes of each
    task are filmed into ``video_dir``."""
    from slurmvla.data.writer import encode_video

    metadata = client.get_server_metadata() or {}
    plan = [(cfg.task, s, False) if isinstance(s, int) else (s[0], s[1], True) for s in seeds]
    results, filmed = [], {}
    for task in dict.fromkeys(t for t, _, _ in plan):
        mine = [(seed, named) for t, seed, named in plan if t == task]
        results += _task_episodes(client, metadata, cfg, task, mine, video_dir, filmed, encode_video)
    return results


def _task_episodes(client: Any, metadata: dict, cfg: RolloutConfig, task: str | None, seeds: list[tuple[int, bool]],
                   video_dir: Path | None, filmed: dict, encode_video: Any) -> list[dict]:
    from slurmvla.sim import make_env

    env = make_env(cfg.env, task, cfg.height, cfg.width, cfg.max_steps)
    try:
        wanted, state_keys = _requested(env, metadata)
        prompt_key = metadata.get("prompt") or "prompt"
        replan = replan_of(cfg, metadata.get("action_horizon"))
        modes = metadata.get("execution_modes") or ["sync", "async"]
        if cfg.execution == "rtc" and "rtc" not in modes:
            raise ValueError(f"rollout.execution=rtc: the server does not offer real-time chunking (its execution_modes: "
                             f"{modes}); serve a policy that supports it, or use rollout.execution=async")
        video_keys = [k for k in env.video_keys if k in env.client_cameras]
        executor = executor_of(_Checked(client, env), cfg, replan, env.fps)
        out = []
        for seed, named in seeds:
            film = video_dir is not None and filmed.get(task, 0) < cfg.videos
            filmed[task] = filmed.get(task, 0) + film
            result = _episode(env, executor, cfg, seed, wanted, state_keys, prompt_key, video_keys,
                              video_dir if film else None, encode_video, task if named else None)
            out.append(result | ({"task": task} if named else {}))
        return out
    finally:
        env.close()


def executor_of(client: Any, cfg: RolloutConfig, replan: int, control_hz: float) -> Executor:
    """The executor ``rollout.execution`` names, asking ``client`` every ``replan`` actions, with the delay
    ``rollout.delay`` says (measured, or ``rollout.delay_steps``), at the environment's ``control_hz``."""
    return Executor(client, cfg.execution, replan, "measured" if cfg.delay == "measured" else cfg.delay_steps,
                    control_hz=control_hz)


def replan_of(cfg: RolloutConfig, horizon: int | None) -> int:
    """The actions of each chunk executed before the next request: ``rollout.replan_steps`` (at most the policy's
    ``horizon``), or by default half of it, in every mode. A server whose
    metadata gives no ``action_horizon`` (None): ``rollout.replan_steps`` as given, or every step, with a warning."""
    if horizon is None:
        if cfg.replan_steps is None:
            log.warning("the server's metadata gives no action_horizon: replanning every step; set "
                        "rollout.replan_steps to the actions of each chunk to execute")
        return cfg.replan_steps or 1
    horizon = int(horizon)
    if cfg.replan_steps is None:
        return max(1, horizon // 2)
    if cfg.replan_steps > horizon:
        log.warning("rollout.replan_steps=%d is more than the policy's action_horizon=%d: replanning every %d",
                    cfg.replan_steps, horizon, horizon)
    return min(cfg.replan_steps, horizon)


def _requested(env: Any, metadata: dict) -> tuple[list[str], list[str]]:
    """The cameras and state keys the server's metadata asks for, each one the environment sends."""
    wanted = [k for k in (metadata.get("cameras") or {}).values() if k]
    unknown = [k for k in wanted if k not in env.client_cameras]
    if unknown or not wanted:
        raise ValueError(f"the server asks for cameras {wanted}; the simulator sends {list(env.client_cameras)} "
                         "(set serve.cameras to those keys)")
    state_keys = metadata.get("state") or list(env.state_keys)
    if [k for k in state_keys if k not in env.state_keys]:
        raise ValueError(f"the server asks for state keys {state_keys}; the simulator sends {list(env.state_keys)} "
                         "(set serve.state to those keys)")
    return wanted, list(state_keys)


def _episode(env: Any, executor: Executor, cfg: RolloutConfig, seed: int, wanted: list[str], state_keys: list[str],
             prompt_key: str, video_keys: list[str], video_dir: Path | None, encode_video: Any,
             task: str | None = None) -> dict:
    env.reset(seed)
    # Before its first chunk the arm rests (the pick task: still, the gripper where it starts).
    executor.reset(rest=env.rest_action())
    total, success, frames, ticks = 0.0, False, [], []
    start = time.perf_counter()
    for _ in range(cfg.max_steps):
        obs = None
        if video_dir is not None:
            obs = env.observe(tuple(dict.fromkeys(wanted + video_keys)))
            frames.append(np.concatenate([obs[k] for k in video_keys], axis=1))

        def request(obs: dict | None = obs) -> dict:
            obs = obs if obs is not None else env.observe(tuple(wanted))
            out = {k: obs[k] for k in wanted}
            out.update({k: obs[k] for k in state_keys})
            out[prompt_key] = env.instruction
            return out

        tick = executor.step(request)
        ticks.append(tick)
        step = env.step(tick.action)
        total += step.reward
        if step.success:
            success = True
            # Success is absorbing: the steps left count at the full reward, so a quick success
            # never returns less than a slow one or a near miss.
            total += float(cfg.max_steps - env.steps)
            break
    result = {"seed": int(seed), "success": success, "return": total, "length": env.steps,
              "requests": executor.requests, "replan_steps": executor.replan, "wall_s": time.perf_counter() - start, **switch_metrics(ticks)}
    if (diagnostics := env.diagnostics()) is not None:
        result["diagnostics"] = diagnostics
    if video_dir is not None and frames:
        path = video_dir / (f"{task}_episode_{seed}.mp4" if task else f"episode_{seed}.mp4")
        encode_video(path, np.stack(frames), codec="h264", fps=env.fps)
        result["video"] = path.name
    log.info("episode %sseed %d: %s in %d steps (return %.2f)", f"{task} " if task else "", seed,
             "success" if success else "failure", env.steps, total)
    return result


class _Checked:
    """The client, its answers checked against the environment's action space."""

    def __init__(self, client: Any, env: Any):
        self.client, self.env = client, env

    def infer(self, request: dict) -> dict:
        answer = self.client.infer(request)
        actions = np.asarray(answer["actions"], dtype=np.float64)
        if actions.ndim != 2 or actions.shape[1] != self.env.action_dim:
            raise ValueError(f"the server returned actions of shape {actions.shape}; the simulator acts in "
                             f"[horizon, {self.env.action_dim}]: {self.env.action_space}")
        return {**answer, "actions": actions}


def connect(host: str, port: int, api_key: str | None = None, timeout_s: float = 120.0, client: Any = None) -> Any:
    """A client (``client``, default :func:`client_class`'s), once the address accepts connections (openpi's own
    client would wait forever for a wrong address) and the server has room for one more (a server at
    ``serve.max_connections`` answers HTTP 503: tried again after its ``Retry-After``, within the same ``timeout_s``)."""
    client = client_class() if client is None else client
    _need("websockets.sync.client")
    from websockets.exceptions import InvalidStatus

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=min(5.0, timeout_s)).close()
        except OSError as e:
            if time.monotonic() > deadline:
                raise ValueError(f"cannot reach ws://{host}:{port} within {timeout_s:g} s ({e}); is the server running "
                                 "there (python -m slurmvla.serve)? rollout.connect_timeout_s waits longer") from None
            time.sleep(0.5)
            continue
        try:
            return client(host=host, port=port, api_key=api_key)
        except InvalidStatus as e:
            if e.response.status_code != 503:
                raise
            if time.monotonic() > deadline:
                body = bytes(e.response.body or b"").decode(errors="replace").strip()
                raise ValueError(f"ws://{host}:{port} stayed busy for {timeout_s:g} s ({body}); "
                                 "rollout.connect_timeout_s waits longer") from None
            time.sleep(_retry_after(e.response.headers.get("Retry-After")))


def _retry_after(value: str | None) -> float:
    """Seconds to wait before trying a busy server again: its ``Retry-After`` (seconds), within 0.1-5 s."""
    try:
        return min(5.0, max(0.1, float(value)))
    except (TypeError, ValueError):
        return 1.0


def history_warning(data: Any, serve: Any, replan_steps: int) -> str | None:
    """What is wrong with the history a served policy reads in a rollout that requests every ``replan_steps``
    steps, or None. ``data`` / ``serve``: the served run's options. The server takes its requests as
    ``serve.request_interval`` steps apart, and a policy with observation history then reads frames other than
    the ones it was trained on."""
    n, interval, every = data.num_obs_history, data.history_interval, serve.request_interval
    if n <= 1 or every == replan_steps:
        return None
    apart = interval // every * replan_steps
    return (f"the policy reads {n} frames data.history_interval={interval} steps apart, but this rollout requests "
            f"every {replan_steps} steps (rollout.replan_steps) and the server takes its requests as "
            f"serve.request_interval={every} apart: it reads frames {apart} steps apart. Train with "
            f"data.history_interval={replan_steps} serve.request_interval={replan_steps}, or roll out with "
            f"rollout.replan_steps={every}")


def run_served(server: Any, cfg: RolloutConfig, seeds: list[int], video_dir: Path | None, client: Any = None) -> list[dict]:
    """Episodes against a :class:`slurmvla.inference.server.PolicyServer` run in this process (on 127.0.0.1),
    through a client (default :func:`client_class`'s) as against any other server."""
    from slurmvla.inference.harness import serving_in_thread

    with serving_in_thread(server) as port:
        client = connect("127.0.0.1", port, client=client)
        try:
            return run_episodes(client, cfg, seeds, video_dir)
        finally:
            close_client(client)


def in_training(policy: Any, cfg: Any, step: int, run_dir: Path, rank: int, world_size: int,
                weights: str = "trained") -> dict | None:
    """The trainer's periodic closed loop (``trainer.rollout_every_steps``): this rank's share of the
    episodes against its copy of ``policy`` (holding the ``weights`` named: trained, or ema for the moving
    average); every rank calls it. Rank 0 gets the metrics of all episodes (and writes
    ``run_dir/rollout/step_N/``); the other ranks get None."""
    from slurmvla.collectives import gather_objects
    from slurmvla.inference.load import Loaded
    from slurmvla.inference.runner import PolicyRunner
    from slurmvla.inference.server import PolicyServer

    rcfg = cfg.rollout
    out = Path(rcfg.out) / f"step_{step:08d}" if rcfg.out else Path(run_dir) / "rollout" / f"step_{step:08d}"
    start = time.perf_counter()
    server = PolicyServer(PolicyRunner(Loaded(policy, cfg, step, str(run_dir), weights)), "127.0.0.1", 0)
    if rank == 0 and (warning := history_warning(cfg.data, cfg.serve, rcfg.replan_steps)) is not None:
        log.warning(warning)
    mine = run_served(server, rcfg, shard_seeds(rcfg, (rank, world_size)), out if rank == 0 else None)
    everyone = gather_objects(mine)
    if rank != 0:
        return None
    summary = summarize([e for part in everyone for e in part], time.perf_counter() - start, groups_of(rcfg))
    summary.update({"source": str(run_dir), "step": step, "weights": weights, "max_steps": rcfg.max_steps,
                    **execution_of(rcfg)})
    out.mkdir(parents=True, exist_ok=True)
    (out / "rollout.json").write_text(json.dumps(summary, indent=1))
    return {k: float(v) for k, v in summary.items() if k.startswith("rollout/")}


def execution_of(cfg: RolloutConfig) -> dict:
    """How the chunks ran and in which simulator, for a summary's header."""
    return {"env": cfg.env, "task": cfg.task, "execution": cfg.execution,
            "delay": "measured" if cfg.delay == "measured" else cfg.delay_steps}


def close_client(client: Any) -> None:
    """Close the client's websocket (openpi's client has no close of its own: its connection is ``_ws``)."""
    from slurmvla.inference.client import WebsocketClient

    if isinstance(client, WebsocketClient):
        client.close()
    elif (ws := getattr(client, "_ws", None)) is not None:
        ws.close()


def shard_seeds(cfg: RolloutConfig, shard: tuple[int, int]) -> list:
    """The episodes of shard ``(I, N)``: every N-th from the I-th of ``rollout.episodes`` environment seeds (from
    ``rollout.first_seed``) of ``rollout.task``; for a suite (``rollout.env=mt50``) of each of its tasks in turn, as
    ``(task, seed)`` pairs."""
    from slurmvla.registry import SIMULATORS

    index, count = shard
    entry = SIMULATORS.get(cfg.env)
    if not entry.suite:
        return [cfg.first_seed + e for e in range(cfg.episodes) if e % count == index]
    plan = [(task, cfg.first_seed + e) for task in entry.tasks_of(cfg.task) for e in range(cfg.episodes)]
    return [p for i, p in enumerate(plan) if i % count == index]


def groups_of(cfg: RolloutConfig) -> dict[str, list[str]]:
    """The groups a summary of ``rollout.env`` reports apart (a suite's; none for one task)."""
    from slurmvla.registry import SIMULATORS

    return SIMULATORS.get(cfg.env).group_table()
