"""Round trip, both halves (run with slurmvla's Python, then with the reference environment's):

    python tests/reference/roundtrip_export.py slurmvla OUT_DIR          # slurmvla's environment
    ../lerobot061/bin/python tests/reference/roundtrip_export.py lerobot OUT_DIR

slurmvla half: the golden LeRobot 0.6.1 pi0 / pi0.5 checkpoint (weights from the seed, LeRobot's saved
config and normalizer) is fine-tuned for a few steps on the sample dataset with the checkpoint's
statistics, exported with ``python -m slurmvla.export RUN OUT --layout lerobot``, and the exported
policy's chunk for the golden inputs and sampling noise is written beside it.
LeRobot half: LeRobot's own PI0Policy / PI05Policy (size tables patched as in the generator) loads the
export with ``load_state_dict(strict=True)`` and samples the same chunk; prints missing / unexpected
keys and the difference.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
GOLDEN = HERE.parent / "golden" / "lerobot061"


def slurmvla_half(out: Path) -> None:
    sys.path.insert(0, str(HERE.parents[1]))
    from safetensors.torch import load_file, save_file

    from slurmvla.inference.load import load_exported
    from tests.policy.test_pi0_parity import META, batch_of, lerobot_checkpoint

    for kind, name in (("pi0", "pi0_tiny"), ("pi05", "pi05_tiny")):
        src = lerobot_checkpoint(kind, out / kind / "source")
        run = out / kind / "run"
        subprocess.run([sys.executable, "-m", "slurmvla.train", "experiment=demo", f"policy={name}",
                        f"policy.pretrained_path={src}", f"policy.tokenizer_path={GOLDEN / 'tokenizer'}",
                        "policy.stats_source=checkpoint", "trainer.max_steps=20", "checkpoint.every_steps=20",
                        f"policy.action_horizon={META['horizon']}",
                        f"hydra.run.dir={run}", "logging.wandb.mode=disabled"], check=True)
        subprocess.run([sys.executable, "-m", "slurmvla.export", str(run), str(out / kind / "export"),
                        "--layout", "lerobot"], check=True)
        loaded = load_exported(run)
        g = load_file(str(GOLDEN / kind / "golden.safetensors"))
        batch = batch_of(loaded.policy, g)
        with torch.no_grad():
            chunk = loaded.policy.sample_actions({k: v for k, v in batch.items() if k not in ("actions", "action_mask")},
                                                 noise=g["sample_noise"])
        save_file({"chunk": chunk.contiguous()}, str(out / kind / "slurmvla_actions.safetensors"))
        print(kind, "exported to", out / kind / "export")


def lerobot_half(out: Path) -> None:
    sys.path.insert(0, str(HERE))
    from generate_pi0_golden import build, inputs, lerobot_batch
    from safetensors.torch import load_file

    report = {}
    for kind in ("pi0", "pi05"):
        policy, pre, post, *_ = build(kind, GOLDEN / "tokenizer")
        state = load_file(str(out / kind / "export" / "model.safetensors"))
        missing, unexpected = policy.load_state_dict(state, strict=False)
        policy.load_state_dict(state, strict=True)  # raises on any missing or unexpected key
        x = inputs()
        policy.model.sample_noise = lambda shape, device, x=x: x["sample_noise"].clone()
        processed = pre(lerobot_batch(x))
        with torch.no_grad():
            chunk = post(policy.predict_action_chunk({k: v for k, v in processed.items() if k != "action"}))
        ours = load_file(str(out / kind / "slurmvla_actions.safetensors"))["chunk"]
        diff = (chunk - ours).abs().max().item()
        report[kind] = {"missing": len(missing), "unexpected": len(unexpected), "keys": len(state),
                        "max_abs_diff": diff, "max_rel_diff": diff / ours.abs().max().item()}
        print(kind, report[kind])
    (out / "lerobot_strict_load.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    side, out = sys.argv[1], Path(sys.argv[2]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    slurmvla_half(out) if side == "slurmvla" else lerobot_half(out)
