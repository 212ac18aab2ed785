"""A LeRobot pi0 / pi0.5 checkpoint directory as a source for export, evaluate and serve.

LeRobot saves a trained policy as a directory: ``model.safetensors``, ``config.json`` (its
``PI0Config`` / ``PI05Config``) and the processors' files, among them the normalizer's statistics.
:func:`lerobot_config` reads that ``config.json`` into the overrides that compose the same model in
slurmvla (size, chunk, padding, image resolution, prompt length, cameras, normalization), with
``policy.pretrained_path`` pointing at the directory and ``policy.stats_source=checkpoint``, so the
weights load strictly and the statistics are LeRobot's own. The caller's overrides come last: a
size LeRobot's tables do not name (``policy=pi05_tiny``, say), ``policy.tokenizer_path`` (LeRobot
does not save the tokenizer) or ``data.root`` for an evaluation.
"""

from __future__ import annotations

import json
from pathlib import Path

from slurmvla.compose import compose
from slurmvla.config import Config

CONFIG_JSON = "config.json"
WEIGHTS = "model.safetensors"
TYPES = ("pi0", "pi05")
# LeRobot's size tables (paligemma_variant, action_expert_variant) -> slurmvla's policy option.
PUBLISHED_VARIANTS = ("gemma_2b", "gemma_300m")
NORMALIZATION = {"MEAN_STD": "mean_std", "MIN_MAX": "min_max", "QUANTILES": "quantile", "IDENTITY": "identity"}


def lerobot_type(path: str | Path) -> str | None:
    """``pi0`` / ``pi05`` for a LeRobot checkpoint directory of one, else None (not such a directory)."""
    path = Path(path)
    if not (path.is_dir() and (path / CONFIG_JSON).is_file() and (path / WEIGHTS).is_file()):
        return None
    try:
        kind = json.loads((path / CONFIG_JSON).read_text()).get("type")
    except (json.JSONDecodeError, AttributeError):
        return None
    return kind if kind in TYPES else None


def not_lerobot_reason(path: str | Path) -> str | None:
    """Why ``path``, a directory that looks like a LeRobot checkpoint (``config.json`` beside
    ``model.safetensors``), is not one of pi0 / pi0.5; None when it is one, or does not look like one."""
    path = Path(path)
    if lerobot_type(path) or not (path.is_dir() and (path / CONFIG_JSON).is_file() and (path / WEIGHTS).is_file()):
        return None
    try:
        kind = json.loads((path / CONFIG_JSON).read_text()).get("type")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return f"{path / CONFIG_JSON} is not a LeRobot config (not a JSON object)"
    return f"{path} is a LeRobot checkpoint of type {kind!r}; slurmvla reads LeRobot's {' and '.join(TYPES)} checkpoints"


def lerobot_overrides(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The overrides that build LeRobot's model from ``path``'s config.json, then ``overrides``."""
    path = Path(path).resolve()
    where = path / CONFIG_JSON
    c = json.loads(where.read_text())  # lerobot_type has read it: a JSON object of a known type
    kind = c["type"]

    def need(key: str):
        if key not in c:
            raise ValueError(f"{where}: no {key!r}; not a LeRobot 0.6 {kind} config")
        return c[key]

    out: list[str] = []
    if not any(o.startswith("policy=") for o in overrides):
        variants = (need("paligemma_variant"), need("action_expert_variant"))
        if variants != PUBLISHED_VARIANTS:
            raise ValueError(f"{where}: paligemma_variant / action_expert_variant {list(variants)} are not the published "
                             f"sizes {list(PUBLISHED_VARIANTS)}; name the slurmvla size that matches, e.g. "
                             f"policy={kind}_tiny")
        out.append(f"policy={kind}")
    resolution = need("image_resolution")
    if len(set(resolution)) != 1:
        raise ValueError(f"{where}: image_resolution={resolution} is not square; slurmvla's pi0 / pi0.5 resize to "
                         "a square policy.image_size")
    inputs, outputs = need("input_features"), need("output_features")
    cameras = [k for k, f in inputs.items() if f.get("type") == "VISUAL"]
    if "observation.state" not in inputs or "action" not in outputs or not cameras:
        raise ValueError(f"{where}: input_features {sorted(inputs)} / output_features {sorted(outputs)} lack "
                         "observation.state, action or a camera")
    try:
        state_dim, action_dim = inputs["observation.state"]["shape"][0], outputs["action"]["shape"][0]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"{where}: input_features.observation.state / output_features.action have no shape "
                         "[dim]; not a LeRobot 0.6 config") from None
    modes = need("normalization_mapping")
    for part in ("STATE", "ACTION"):
        if modes.get(part) not in NORMALIZATION:
            raise ValueError(f"{where}: normalization_mapping.{part}={modes.get(part)!r}; known: {sorted(NORMALIZATION)}")
    out += [
        f"policy.pretrained_path={path}",
        "policy.stats_source=checkpoint",
        f"policy.action_horizon={need('chunk_size')}",
        f"policy.num_inference_steps={need('num_inference_steps')}",
        f"policy.max_text_len={need('tokenizer_max_length')}",
        f"policy.max_state_dim={need('max_state_dim')}",
        f"policy.max_action_dim={need('max_action_dim')}",
        f"policy.image_size={resolution[0]}",
        f"policy.num_cameras={len(cameras) + int(c.get('empty_cameras', 0))}",
        f"policy.state_dim={state_dim}",
        f"policy.action_dim={action_dim}",
        f"policy.state_normalization={NORMALIZATION[modes['STATE']]}",
        f"policy.action_normalization={NORMALIZATION[modes['ACTION']]}",
        f"data.cameras=[{','.join(cameras)}]",
        "data.state_keys=[observation.state]",
        "data.action_keys=[action]",
    ]
    return out + list(overrides)


def lerobot_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The slurmvla config of LeRobot's model in ``path`` (see the module's docstring)."""
    cfg = compose(lerobot_overrides(path, overrides))
    kind = lerobot_type(path)
    if cfg.policy.name != kind:
        raise ValueError(f"{Path(path) / CONFIG_JSON} is a LeRobot {kind} checkpoint; policy={cfg.policy.name} cannot "
                         f"load it (choose a {kind} size: {kind}, {kind}_tiny)")
    return cfg
