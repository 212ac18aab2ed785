"""Print slurmvla's distance to LeRobot 0.6.1's golden outputs (tests/golden/lerobot061), and how far
each published detail moves the loss when it is reverted (the negative controls' sizes). Runs in
slurmvla's environment; the suite asserts the same comparisons (tests/policy/test_pi0_parity.py).

    python tests/reference/parity_figures.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import slurmvla.policy.pi0.model as pi0  # noqa: E402
from tests.policy.test_pi0_parity import (  # noqa: E402
    GOLDEN,
    META,
    batch_of,
    built,
    capture_velocity,
    lerobot_checkpoint,
    load_file,
    rel,
)


def fig(a: torch.Tensor, b: torch.Tensor) -> str:
    return f"abs {float((a.double() - b.double()).abs().max()):.2e} rel {rel(a, b):.2e}"


def main() -> None:
    d = META["action_dim"]
    for kind in ("pi0", "pi05"):
        folder = lerobot_checkpoint(kind, Path(tempfile.mkdtemp()))
        g = load_file(str(GOLDEN / kind / "golden.safetensors"))
        _, policy = built(kind, folder)
        batch = batch_of(policy, g)
        seen = capture_velocity(policy)
        with torch.no_grad():
            out = policy(batch, noise=g["noise"], t=g["time"])
            chunk = policy.sample_actions({k: v for k, v in batch.items() if k not in ("actions", "action_mask")},
                                          noise=g["sample_noise"])
            pixels = policy._pixels(g["frames"].flatten(0, 1)).reshape(g["pixels"].shape)
            ids, _ = policy._text(batch)
        print(f"{kind}: loss {fig(out['loss'].reshape(1), g['loss'])} | per-sample loss "
              f"{fig(out['components']['mse'][0], g['losses'][..., :d].sum((1, 2)))} | velocity "
              f"{fig(seen['v'], g['velocity'])} | chunk {fig(chunk, g['chunk'])} | pixels {fig(pixels, g['pixels'])} | "
              f"token ids equal: {torch.equal(ids, g['prompt_ids'])}")
        reverted = {}
        for change in ("antialias", "unpadded noise", "one bin off"):
            if change == "one bin off" and kind == "pi0":
                continue
            _, policy = built(kind, folder)
            noise, real, prompts = g["noise"].clone(), pi0.F.interpolate, getattr(type(policy), "prompts", None)
            if change == "antialias":
                pi0.F.interpolate = lambda *a, real=real, **kw: real(*a, **{**kw, "antialias": True})
            elif change == "unpadded noise":
                noise[..., d:] = 0
            else:
                type(policy).prompts = lambda self, b, prompts=prompts: [t.replace("State: ", "State: 1")
                                                                      for t in prompts(self, b)]
            try:
                with torch.no_grad():
                    loss = policy(batch_of(policy, g), noise=noise, t=g["time"])["loss"]
            finally:
                pi0.F.interpolate = real
                if prompts is not None:
                    type(policy).prompts = prompts
            reverted[change] = f"{rel(loss.reshape(1), g['loss']):.2e}"
        print(f"{kind}: loss moves by (relative) when reverted: {reverted}")


if __name__ == "__main__":
    main()
