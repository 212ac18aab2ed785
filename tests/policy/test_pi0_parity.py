"""pi0 and pi0.5 against LeRobot 0.6.1, the published implementation (the test oracle).

tests/reference/generate_pi0_golden.py ran LeRobot's own PI0Policy / PI05Policy (its size tables
patched to a tiny size, nothing else) in its own environment and committed its outputs under
tests/golden/lerobot061/. Here slurmvla rebuilds the same weights from the same seed, writes them as
a LeRobot checkpoint directory (with LeRobot's saved config and normalizer), loads it through
``policy.pretrained_path`` with ``policy.stats_source=checkpoint``, and must reproduce, from the
same raw uint8 frames through its own preprocessing: the preprocessed pixels, the prompt's token
ids, the velocity at one (x_t, t), the per-element and total loss, and the sampled chunk.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from slurmvla.data.mixture import offset_scale
from slurmvla.policy import build_policy
from slurmvla.policy.pi0.model import Pi0Policy
from slurmvla.policy.stats import checkpoint_stats

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parents[1] / "reference"))
from tiny_weights import fingerprint, tiny_state_dict  # noqa: E402

from tests.policy.test_pi0 import policy_cfg  # noqa: E402

GOLDEN = Path(__file__).parents[1] / "golden" / "lerobot061"
META = json.loads((GOLDEN / "meta.json").read_text())
RTOL = 1e-5
NAMES = {"pi0": "pi0_tiny", "pi05": "pi05_tiny"}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12))


def lerobot_checkpoint(kind: str, folder: Path) -> Path:
    """LeRobot's checkpoint directory: its saved config and processors, weights from the seed."""
    shutil.copytree(GOLDEN / kind / "checkpoint", folder, dirs_exist_ok=True)
    sd = json.loads((GOLDEN / kind / "state_dict.json").read_text())
    tensors = tiny_state_dict(sd["shapes"], sd["ties"], META["seed"])
    assert fingerprint(tensors) == pytest.approx(META[kind]["weights_fingerprint"], rel=1e-12), \
        "numpy made other weights from the seed than the generator did"
    save_file({k: torch.from_numpy(v) for k, v in tensors.items() if k in sd["saved_keys"]},
              str(folder / "model.safetensors"))
    return folder


def built(kind: str, folder: Path, **over):
    cfg = policy_cfg(NAMES[kind], pretrained_path=str(folder), tokenizer_path=str(GOLDEN / "tokenizer"),
                     stats_source="checkpoint", action_horizon=META["horizon"], state_dim=META["state_dim"],
                     action_dim=META["action_dim"], max_text_len=48 if kind == "pi0" else 200, **over)
    raw, _ = checkpoint_stats(folder)
    mode = "quantile" if kind == "pi05" else "mean_std"
    stats = {**offset_scale(raw["state"], mode, cfg.state_dim, "state", "golden"),
             **offset_scale(raw["action"], mode, cfg.action_dim, "action", "golden")}
    return cfg, build_policy(cfg, stats).eval()


def batch_of(policy, g: dict) -> dict:
    frames = g["frames"]  # [B, 2 present cameras, H, W, 3]
    b = frames.shape[0]
    images = torch.cat([frames, torch.zeros_like(frames[:, :1])], dim=1)  # the third camera absent
    batch = {"images": images, "image_mask": torch.tensor([[True, True, False]] * b), "state": g["state"],
             "actions": g["actions"], "action_mask": torch.ones(b, META["horizon"], dtype=torch.bool),
             "instruction": list(META["tasks"])}
    spec = type(policy).sample_spec(policy.cfg)
    if spec.tokenizer is not None:
        ids, masks = zip(*(spec.tokenizer(t) for t in META["tasks"]))
        batch["text"], batch["text_mask"] = torch.stack(ids), torch.stack(masks)
    return batch


def capture_velocity(policy):
    seen = {}
    def keep(module, args, output):  # returns None: the output itself is left alone
        seen.setdefault("v", output.detach().clone())

    policy.action_out_proj.register_forward_hook(keep)
    return seen


@pytest.fixture(scope="module", params=["pi0", "pi05"])
def case(request, tmp_path_factory):
    kind = request.param
    folder = lerobot_checkpoint(kind, tmp_path_factory.mktemp(kind))
    return kind, folder, load_file(str(GOLDEN / kind / "golden.safetensors"))


def test_pixels_match_lerobot_preprocessing(case):
    kind, folder, g = case
    _, policy = built(kind, folder)
    frames = g["frames"].flatten(0, 1)
    pixels = policy._pixels(frames).reshape(g["pixels"].shape)
    assert rel(pixels, g["pixels"]) < RTOL


def test_prompt_token_ids_equal_lerobots(case):
    kind, folder, g = case
    _, policy = built(kind, folder)
    batch = batch_of(policy, g)
    ids, mask = policy._text(batch)
    assert torch.equal(mask, g["prompt_mask"])
    assert torch.equal(ids[mask], g["prompt_ids"][g["prompt_mask"]])


def test_loss_and_velocity_match_lerobot(case):
    kind, folder, g = case
    _, policy = built(kind, folder)
    batch = batch_of(policy, g)
    seen = capture_velocity(policy)
    with torch.no_grad():
        out = policy(batch, noise=g["noise"], t=g["time"])
    assert rel(seen["v"], g["velocity"]) < RTOL
    assert rel(out["loss"].reshape(1), g["loss"]) < RTOL
    per_sample, count = out["components"]["mse"]
    expected = g["losses"][..., : META["action_dim"]]
    assert torch.allclose(per_sample, expected.sum(dim=(1, 2)), rtol=RTOL)
    assert torch.equal(count, torch.full_like(count, expected[0].numel()))


def test_sampled_chunk_matches_lerobot(case):
    kind, folder, g = case
    _, policy = built(kind, folder)
    batch = batch_of(policy, g)
    with torch.no_grad():
        chunk = policy.sample_actions({k: v for k, v in batch.items() if k not in ("actions", "action_mask")},
                                      noise=g["sample_noise"])
    assert rel(chunk, g["chunk"]) < RTOL
    normalized = (chunk - policy.action_offset) / policy.action_scale
    assert rel(normalized, g["chunk_normalized"]) < 1e-4  # unnormalize + normalize round-off


@pytest.mark.parametrize("change", ["bins", "prompt", "antialias", "unpadded_noise"])
def test_one_published_detail_changed_breaks_parity(case, change, monkeypatch):
    """Negative controls: each published detail matters at the tolerance the parity tests use."""
    kind, folder, g = case
    _, policy = built(kind, folder)
    batch = batch_of(policy, g)
    noise = g["noise"]
    if change in ("bins", "prompt"):
        if kind == "pi0":
            pytest.skip("pi0's prompt carries no state")
        original = type(policy).prompts

        def prompts(self, b):
            texts = original(self, b)
            if change == "prompt":
                return [t.replace("Task: ", "Task:") for t in texts]
            return [t.replace("State: ", "State: 1") for t in texts]  # every first bin off

        monkeypatch.setattr(type(policy), "prompts", prompts)
    elif change == "antialias":
        import slurmvla.policy.pi0.model as pi0

        real = pi0.F.interpolate
        monkeypatch.setattr(pi0.F, "interpolate", lambda *a, **kw: real(*a, **{**kw, "antialias": True}))
    else:  # noise only in the data's dims, zeros in the padding
        noise = noise.clone()
        noise[..., META["action_dim"]:] = 0
    seen = capture_velocity(policy)
    with torch.no_grad():
        policy(batch, noise=noise, t=g["time"])
    assert rel(seen["v"], g["velocity"]) > 100 * RTOL


def test_checkpoint_statistics_are_lerobots_normalizer(case):
    kind, folder, g = case
    _, policy = built(kind, folder)
    normalized = (g["state"] - policy.state_offset) / policy.state_scale
    assert rel(normalized, g["normalized_state"]) < RTOL
    actions = (g["actions"] - policy.action_offset) / policy.action_scale
    assert rel(actions, g["normalized_actions"]) < RTOL


def test_a_lerobot_checkpoint_missing_a_tensor_is_named_unless_partial_load_is_asked(case, tmp_path):
    kind, folder, _ = case
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    tensors = load_file(str(folder / "model.safetensors"))
    gone = "model.action_in_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != gone}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"1 tensor\(s\) policy=pi0?5? needs are missing .*action_in_proj.weight"):
        built(kind, tmp_path)
    built(kind, tmp_path, allow_partial_load=True)
    extra = dict(tensors, **{"model.something_else.weight": torch.zeros(2)})
    save_file(extra, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="something_else"):
        built(kind, tmp_path)


def test_export_in_lerobot_layout_is_lerobots_complete_key_set_and_round_trips(case, tmp_path):
    """The export holds exactly the keys LeRobot 0.6.1's own save_pretrained writes, with LeRobot's
    shapes; the tensors the policy does not compute with come back from the source checkpoint, so a
    LeRobot checkpoint -> slurmvla -> LeRobot round trip is bitwise."""
    from slurmvla.policy.pi0.weights import lerobot_state_dict

    kind, folder, _ = case
    cfg, policy = built(kind, folder)
    sd = json.loads((GOLDEN / kind / "state_dict.json").read_text())
    exported = lerobot_state_dict(policy, cfg.pretrained_path)
    assert sorted(exported) == sd["saved_keys"]
    assert all(list(v.shape) == sd["shapes"][k] for k, v in exported.items())
    source = load_file(str(folder / "model.safetensors"))
    assert all(torch.equal(exported[k], source[k]) for k in source)
    # Without the source file: complete all the same (LM head = embeddings, the rest zero).
    fresh = lerobot_state_dict(policy)
    assert sorted(fresh) == sd["saved_keys"]


def test_continuous_state_variant_is_explicit_and_loads_only_partially(case):
    kind, folder, _ = case
    if kind != "pi05":
        pytest.skip("pi0.5 only")
    with pytest.raises(ValueError, match="state_input=continuous"):
        built(kind, folder, state_input="continuous")
    _, policy = built(kind, folder, state_input="continuous", allow_partial_load=True)
    assert isinstance(policy, Pi0Policy) and hasattr(policy, "state_proj")


def test_heads_are_padded_to_32_and_noise_is_drawn_there():
    cfg = policy_cfg("pi05_tiny")
    spec = type(build_policy(cfg)).sample_spec(cfg)
    assert [d.shape for d in spec.draws if d.name == "noise"] == [(cfg.action_horizon, 32)]
    policy = build_policy(dataclasses.replace(cfg, action_dim=7))
    assert policy.action_out_proj.out_features == 32
    chunk = policy.sample_actions({"images": torch.zeros(1, 3, 64, 64, 3, dtype=torch.uint8),
                                   "image_mask": torch.ones(1, 3, dtype=torch.bool), "state": torch.zeros(1, 8),
                                   "instruction": ["x"]})
    assert chunk.shape == (1, cfg.action_horizon, 7) and np.isfinite(chunk.numpy()).all()


def test_openpi_norm_stats_json_gives_the_same_statistics_as_lerobots_normalizer(case, tmp_path):
    """openpi's assets/<id>/norm_stats.json holding the same numbers as LeRobot's saved normalizer
    gives the same offset / scale; a malformed one is named."""
    kind, folder, _ = case
    raw, _ = checkpoint_stats(folder)
    assets = tmp_path / "assets" / "droid"
    assets.mkdir(parents=True)
    as_lists = {k: {s: np.asarray(v).tolist() for s, v in d.items()} for k, d in raw.items()}
    (assets / "norm_stats.json").write_text(json.dumps({"norm_stats": {"state": as_lists["state"],
                                                                       "actions": as_lists["action"]}}))
    openpi, where = checkpoint_stats(tmp_path)
    assert where == assets / "norm_stats.json"
    for part, dim in (("state", META["state_dim"]), ("action", META["action_dim"])):
        for mode in ("quantile", "mean_std"):
            a = offset_scale(raw[part], mode, dim, part, "lerobot")
            b = offset_scale(openpi[part], mode, dim, part, "openpi")
            assert all(torch.allclose(a[k], b[k], rtol=1e-6) for k in a)
    (assets / "norm_stats.json").write_text(json.dumps({"stats": {}}))
    with pytest.raises(ValueError, match="norm_stats.json: not openpi's"):
        checkpoint_stats(tmp_path)


def test_a_pi05_prompt_that_fills_max_text_len_is_warned_about_once(caplog):
    cfg = policy_cfg("pi05_tiny", max_text_len=40)
    policy = build_policy(cfg)
    batch = {"state": torch.zeros(2, 8), "instruction": ["pick up the red block", "x"]}
    with caplog.at_level("WARNING", logger="slurmvla.policy.pi0.model"):
        policy._text(batch)
        policy._text(batch)
    assert [r.getMessage() for r in caplog.records].count(
        "a pi0.5 prompt filled policy.max_text_len=40 tokens and may be cut (the state ids and 'Action: ' come last); "
        "raise policy.max_text_len") == 1
    caplog.clear()
    with caplog.at_level("WARNING", logger="slurmvla.policy.pi0.model"):
        build_policy(policy_cfg("pi05_tiny"))._text(batch)  # 128 holds these prompts
    assert not caplog.records


# -- a LeRobot checkpoint directory as the source of export, evaluate and serve -------------------

def lerobot_source_overrides(kind: str) -> list[str]:
    # The golden checkpoint's sizes are LeRobot's patched tiny tables; LeRobot saves no tokenizer.
    return [f"policy={NAMES[kind]}", f"policy.tokenizer_path={GOLDEN / 'tokenizer'}"]


def golden_chunk_of(policy, g: dict) -> torch.Tensor:
    batch = batch_of(policy, g)
    with torch.no_grad():
        return policy.sample_actions({k: v for k, v in batch.items() if k not in ("actions", "action_mask")},
                                     noise=g["sample_noise"])


def test_a_lerobot_checkpoint_directory_loads_with_its_config_statistics_and_weights(case):
    from slurmvla.inference.load import load_exported

    kind, folder, g = case
    loaded = load_exported(folder, lerobot_source_overrides(kind))
    pc = loaded.cfg.policy
    assert (pc.stats_source, pc.action_horizon, pc.max_text_len, pc.image_size) == \
        ("checkpoint", META["horizon"], 200 if kind == "pi05" else 48, META["image_size"])
    assert list(loaded.cfg.data.cameras) == META["cameras"]
    assert rel(golden_chunk_of(loaded.policy, g), g["chunk"]) < RTOL


def test_a_lerobot_checkpoint_directory_exports_in_both_layouts(case, tmp_path):
    # The CLI, in this process (its start-up is tested elsewhere).
    from slurmvla.export import main
    from slurmvla.inference.load import load_exported

    kind, folder, g = case

    main([str(folder), str(tmp_path / "policy.safetensors"), *lerobot_source_overrides(kind)])
    from_file = load_exported(tmp_path / "policy.safetensors")
    assert rel(golden_chunk_of(from_file.policy, g), g["chunk"]) < RTOL
    main([str(folder), str(tmp_path / "lerobot"), "--layout", "lerobot", *lerobot_source_overrides(kind)])
    again, source = load_file(str(tmp_path / "lerobot" / "model.safetensors")), load_file(str(folder / "model.safetensors"))
    assert sorted(again) == sorted(source) and all(torch.equal(again[k], source[k]) for k in source)
    assert (tmp_path / "lerobot" / "config.json").read_text() == (folder / "config.json").read_text()


def test_a_lerobot_checkpoint_directory_serves_lerobots_actions_to_openpis_client(case):
    """The server's whole path (client keys -> frames, state, prompt -> the policy -> dataset units)
    on LeRobot's checkpoint gives LeRobot's chunk; only the noise is LeRobot's instead of the seed's."""
    import asyncio
    import threading

    wcp = pytest.importorskip("openpi_client.websocket_client_policy", reason="pip install --no-deps openpi-client")
    from slurmvla.inference.build import build_server

    kind, folder, g = case
    server = build_server(str(folder), [*lerobot_source_overrides(kind), "serve.host=127.0.0.1", "serve.port=0",
                                        "serve.cameras=[observation/exterior_image_1_left,"
                                        "observation/exterior_image_2_left,null]"], device="cpu")
    policy, sample = server.policy.policy, server.policy.policy.sample_actions
    ready, loop, stop = threading.Event(), asyncio.new_event_loop(), None

    def run() -> None:
        nonlocal stop
        stop = asyncio.Event()
        loop.run_until_complete(server.run(ready, stop))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        assert ready.wait(60), "the server did not start"
        client = wcp.WebsocketClientPolicy("127.0.0.1", server.port)
        for i, task in enumerate(META["tasks"]):
            policy.sample_actions = lambda batch, i=i: sample(batch, noise=g["sample_noise"][i:i + 1])
            state = g["state"][i].numpy()
            reply = client.infer({"observation/exterior_image_1_left": g["frames"][i, 0].numpy(),
                                  "observation/exterior_image_2_left": g["frames"][i, 1].numpy(),
                                  "observation/joint_position": state[:7], "observation/gripper_position": state[7:],
                                  "prompt": task})
            assert rel(torch.from_numpy(np.array(reply["actions"])), g["chunk"][i]) < RTOL
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)


def test_a_lerobot_checkpoint_directory_is_evaluated_on_episodes(case, sample_root, tmp_path):
    from slurmvla.evaluate import main as evaluate_main  # the CLI, in this process

    kind, folder, _ = case
    evaluate_main([str(folder), "--out", str(tmp_path), "--split", "all", "--plot-episodes", "0", "--batch-size", "64",
                   *lerobot_source_overrides(kind), f"data.root={sample_root}", "data.num_workers=0"])
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["num_samples"] > 0 and np.isfinite(metrics["chunk_mse"])


def test_a_lerobot_checkpoint_directory_without_its_tokenizer_or_at_an_unknown_size_is_one_line(case, capsys):
    from slurmvla.serve import main as serve_main  # the CLI, in this process

    kind, folder, _ = case
    for args, expected in (([f"policy={NAMES[kind]}"], "holds no tokenizer"),
                           ([], "are not the published sizes")):
        with pytest.raises(SystemExit) as stop:
            serve_main([str(folder), "--host", "127.0.0.1", "--port", "0", *args])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and expected in err and len(err.strip().splitlines()) == 1, err
