"""Which normalization statistics a run uses: the configured datasets' (``policy.stats_source=data``)
or those saved beside the pretrained weights (``checkpoint``): LeRobot's saved normalizer
(``policy_preprocessor_step_*_normalizer_processor.safetensors``) or openpi's ``norm_stats.json``.
The modes are the policy's when it names them (pi0.5: quantile), else the data config's."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

from slurmvla.data.mixture import Mixture, offset_scale

log = logging.getLogger(__name__)


def normalization_modes(cfg) -> tuple[tuple[str, str], tuple[str, str]]:
    """``((state mode, the setting that chose it), (action mode, its setting))``."""
    return tuple((getattr(cfg.policy, k), f"policy.{k}") if getattr(cfg.policy, k) else (getattr(cfg.data, k), f"data.{k}")
                 for k in ("state_normalization", "action_normalization"))


def checkpoint_stats(path: str | Path, asset_id: str | None = None) -> tuple[dict[str, dict[str, np.ndarray]], Path]:
    """``({"state": {...}, "action": {...}}, file)`` from a LeRobot checkpoint directory or an openpi
    one (``norm_stats.json`` there or under ``assets/<asset_id>/``: ``asset_id`` picks one where there are
    several)."""
    root = Path(path).expanduser()
    root = root.parent if root.is_file() else root
    lerobot = sorted(root.glob("policy_preprocessor*normalizer_processor.safetensors"))
    if lerobot:
        from safetensors.numpy import load_file

        flat = load_file(str(lerobot[0]))
        out = {"state": {}, "action": {}}
        for key, value in flat.items():
            feature, _, stat = key.rpartition(".")
            if feature == "observation.state":
                out["state"][stat] = value
            elif feature == "action":
                out["action"][stat] = value
        return out, lerobot[0]
    assets = sorted(root.glob("assets/*/norm_stats.json"))
    ids = [f.parent.name for f in assets]
    if asset_id is not None:
        if asset_id not in ids:
            raise ValueError(f"policy.openpi_asset_id={asset_id!r}: {root / 'assets'} holds no {asset_id}/norm_stats.json; "
                             f"its asset ids: {ids or 'none'}")
        assets = [root / "assets" / asset_id / "norm_stats.json"]
    candidates = [root / "norm_stats.json", *assets] if asset_id is None else assets
    found = [c for c in candidates if c.exists()]
    if len(found) > 1 and found[0] != root / "norm_stats.json":
        raise ValueError(f"policy.stats_source=checkpoint: {root} holds several openpi norm_stats.json (assets "
                         f"{ids}); pick one with policy.openpi_asset_id (one of {ids})")
    if not found:
        raise ValueError(f"policy.stats_source=checkpoint: {root} holds no normalization statistics (LeRobot's "
                         "policy_preprocessor_step_*_normalizer_processor.safetensors or openpi's norm_stats.json); "
                         "use policy.stats_source=data")
    try:
        stats = json.loads(found[0].read_text())["norm_stats"]
        out = {"state": stats["state"], "action": stats["actions"]}
    except (KeyError, json.JSONDecodeError) as e:
        raise ValueError(f"{found[0]}: not openpi's norm_stats.json layout ({{'norm_stats': {{'state': ..., "
                         f"'actions': ...}}}}): {e}") from None
    return {k: {s: np.asarray(v, dtype=np.float64) for s, v in d.items() if v is not None} for k, d in out.items()}, \
        found[0]


def checkpoint_normalization(cfg, state_dim: int, action_dim: int) -> tuple[dict[str, torch.Tensor], Path]:
    """The offset / scale buffers from the statistics saved beside ``policy.pretrained_path``, and their file."""
    (state_mode, state_knob), (action_mode, action_knob) = normalization_modes(cfg)
    raw, where = checkpoint_stats(cfg.policy.pretrained_path, getattr(cfg.policy, "openpi_asset_id", None))
    return {**offset_scale(raw["state"], state_mode, state_dim, "state", str(where), state_knob),
            **offset_scale(raw["action"], action_mode, action_dim, "action", str(where), action_knob)}, where


def resolve_stats(cfg, mixture: Mixture, announce: bool = True) -> dict[str, torch.Tensor]:
    """The policy's offset / scale buffers for this run, logged once (``announce``)."""
    (state_mode, state_knob), (action_mode, action_knob) = normalization_modes(cfg)
    source = getattr(cfg.policy, "stats_source", "data")  # only policies that load weights have the choice
    if source == "checkpoint":
        out, where = checkpoint_normalization(cfg, mixture.features.state_dim, mixture.features.action_dim)
    else:
        where = f"the data ({', '.join(mixture.names)})"
        out = mixture.normalization(state_mode, action_mode, (state_knob, action_knob))
    if announce:
        log.info("normalization: state %s, action %s; statistics from %s (policy.stats_source=%s)", state_mode,
                 action_mode, where, source)
        if cfg.data.delta_actions and source == "checkpoint":
            log.info("data.delta_actions: the checkpoint's action statistics are used as saved; they must be those "
                     "of the deltas (as openpi's norm_stats.json for a delta-action recipe are)")
    return out
