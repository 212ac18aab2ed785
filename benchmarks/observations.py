"""The observation the latency benchmarks send (sample_latency.py, rtc_cost.py): what openpi's DROID client sends,
with an image for every camera the policy reads.

The cameras are the composed config's ``serve.cameras`` (one client key per entry of ``data.cameras``). An entry
the default client leaves out (null: pi0 / pi0.5's three-camera layout, whose second exterior camera that client
never sends) is sent here under the DROID client's name for it, so that every camera the policy reads costs its
time: three cameras by default, two under ``experiment=pi05_droid`` (exterior 1 and the wrist).
"""

from __future__ import annotations

import numpy as np
import torch

from slurmvla.compose import compose
from slurmvla.config import Config
from slurmvla.data.processor import Processor
from slurmvla.droid_features import DROID_CLIENT_CAMERAS


def compose_every_camera_sent(overrides: list[str]) -> tuple[Config, list[str]]:
    """The config, with a client key for every camera, and those keys in ``data.cameras``' order."""
    cfg = compose(overrides)
    keys = [key or (DROID_CLIENT_CAMERAS[i] if i < len(DROID_CLIENT_CAMERAS) else f"observation/camera_{i}")
            for i, key in enumerate(cfg.serve.cameras)]
    if keys != list(cfg.serve.cameras):
        cfg = compose([*overrides, f"serve.cameras=[{','.join(keys)}]"])
    return cfg, keys


def observation(cameras: list[str], seed: int = 0) -> dict:
    """One request: a 180 x 320 image per camera (DROID's recorded size), 7 joint positions, the gripper, a prompt."""
    g = np.random.default_rng(seed)
    obs = {key: g.integers(0, 256, (180, 320, 3), dtype=np.uint8) for key in cameras}
    return obs | {"observation/joint_position": g.normal(size=7), "observation/gripper_position": g.uniform(size=1),
                  "prompt": "put the marker in the cup"}


def observation_as_batch(obs: dict, cameras: list[str], spec, cfg: Config, device: torch.device) -> dict:  # noqa: ANN001
    """``obs`` as the server prepares it for the policy (``spec``: its sample spec), on ``device``: the policy's
    processor (each camera at the policy's image size, or as sent for a policy that resizes frames itself; the
    state; the prompt). ``cameras``: the client keys of ``cfg.serve.cameras`` (:func:`compose_every_camera_sent`)."""
    processor = Processor.of(cfg, spec)
    batch = processor.batch([processor.read(obs)])
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
