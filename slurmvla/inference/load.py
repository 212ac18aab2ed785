"""A trained policy rebuilt from its config alone and loaded with its weights: from a file written by
``python -m slurmvla.export`` (its metadata carries the config), a checkpoint folder, a run directory (its
newest complete checkpoint; the config is the run's ``config.resolved.yaml``) or a LeRobot pi0 / pi0.5
checkpoint directory (:mod:`slurmvla.inference.lerobot_checkpoint`: its weights, statistics and config, loaded
strictly). The server, the evaluator, the closed loop and the exporter load through :func:`load_exported`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors import safe_open
from safetensors.torch import load_file

from slurmvla.checkpoint import EMA_FILE, LORA_BASE, load_model_file, read_meta, resolve_checkpoint
from slurmvla.compose import check_override_keys, explain_config_error, to_config
from slurmvla.config import Config
from slurmvla.engine.materialize import has_meta_parameters
from slurmvla.formats import EXPORT, EXPORT_KEY, RUN_DIR, run_dir_version, saved_config
from slurmvla.inference.lerobot_checkpoint import lerobot_config, lerobot_type, not_lerobot_reason
from slurmvla.parameters import checkpoint_keys
from slurmvla.policy import Policy, build_policy

CONFIG_FILE = "config.resolved.yaml"
log = logging.getLogger("slurmvla.export")


@dataclass
class Loaded:
    policy: Policy  # in eval mode, on ``device``
    cfg: Config  # the run's resolved config with the overrides applied
    step: int
    source: str  # the file or checkpoint folder the weights came from
    weights: str = "trained"  # trained, or ema: the moving average of them (serve.weights)


def load_exported(source: str | Path, overrides: list[str] | tuple[str, ...] = (),
                  device: str | torch.device = "cpu", ema: bool | None = None, merge: bool = True) -> Loaded:
    """The trained policy, rebuilt from its config alone and loaded with its weights.

    ``source``: a file written by ``python -m slurmvla.export`` (its metadata carries the config), a checkpoint
    folder, or a run directory (its newest complete checkpoint; the config is the run's
    ``config.resolved.yaml``). ``overrides``: Hydra-style ``key=value`` pairs applied to that config
    (e.g. ``policy.num_inference_steps=5``, ``data.root=...``). A ValueError names the file and what
    is wrong with it. A LoRA run's adapters are rebuilt onto its base and, with ``merge`` (the default),
    folded into it. ``ema``: the checkpoint's moving average of the weights (True) or its trained weights
    (False); None: as ``serve.weights`` of the config with the overrides says (:func:`wants_average`)."""
    path = Path(source)
    if ema and (not path.is_dir() or lerobot_type(path)):
        raise ValueError(f"--ema reads a slurmvla checkpoint's moving average; {str(path)!r} is not a checkpoint "
                         "folder or run directory")
    if lerobot_type(path):
        loaded = _load_lerobot(path, overrides, device)
        _one_set_of_weights(loaded.cfg, path, "a LeRobot checkpoint directory (one set of weights)")
        return loaded
    if path.is_file():
        try:
            with safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
        except Exception as e:  # safetensors raises its own error types for a file that is not one
            raise ValueError(f"{str(path)!r} is not a safetensors file written by slurmvla.export ({e})") from None
        version = EXPORT.version(metadata.get(EXPORT_KEY), path)  # first: a newer file may keep its config elsewhere
        if "config_yaml" not in metadata:
            raise ValueError(f"{str(path)!r} carries no config in its metadata (exported from a checkpoint without "
                             f"its run directory's {CONFIG_FILE}); load the run directory instead")
        step, origin = int(metadata.get("step", -1)), str(path)
        base = json.loads(metadata[LORA_BASE]) if LORA_BASE in metadata else None
        where = f"the config in {path}'s metadata"
        cfg = read_config(saved_config(metadata["config_yaml"], EXPORT, version, where), list(overrides), where)
        weights = "ema" if metadata.get("weights") == "moving average" else "trained"
        if weights == "trained":
            _one_set_of_weights(cfg, path, "an exported file of the trained weights (python -m slurmvla.export "
                                "--weights ema writes the average)")
        state = load_file(str(path))
    elif path.is_dir():
        if reason := not_lerobot_reason(path):
            raise ValueError(reason)
        checkpoint = resolve_checkpoint(path)
        config = checkpoint.parent.parent / CONFIG_FILE
        if not config.is_file():
            raise ValueError(f"checkpoint {checkpoint} has no {CONFIG_FILE} in its run directory {config.parent}: "
                             "the policy cannot be rebuilt without its config")
        cfg = read_config(run_config(config.parent), list(overrides), str(config))
        meta = read_meta(checkpoint)
        step, base = int(meta["step"]), meta.get(LORA_BASE)
        average = wants_average(cfg.serve.weights, checkpoint) if ema is None else ema
        weights = "ema" if average else "trained"
        origin, state = str(checkpoint), load_model_file(checkpoint, ema=average)
    else:
        raise ValueError(f"{str(path)!r} does not exist; give an exported .safetensors file, a checkpoint folder "
                         "or a run directory")
    if cfg.policy.lora.enabled:
        return dataclasses.replace(_load_adapted(cfg, state, step, origin, device, merge, base), weights=weights)
    # The trained weights (and normalization buffers) replace any pretrained ones: do not read (or
    # need) the pretrained file; keep its tokenizer, which the policy's prompts are written with.
    # A policy that can initialise parameter by parameter is built on the meta device and takes the loaded
    # tensors as its parameters: no random initialisation of weights about to be replaced (at pi0.5's
    # size that initialisation, not the file, was most of the load).
    policy = build_policy(_without_pretrained(cfg.policy), on_meta=True)
    deferred = has_meta_parameters(policy)
    missing, unexpected = _mismatch(policy.state_dict(), state)
    if missing or unexpected:
        raise ValueError(f"{origin}: the weights do not fit the policy its config builds ({cfg.policy.name}); "
                         f"missing: {missing[:5]}, unexpected: {unexpected[:5]}")
    policy.load_state_dict(state, assign=deferred)
    return Loaded(policy.to(device).eval(), cfg, step, origin, weights)


def run_config(run_dir: Path) -> str:
    """A run directory's saved config (``config.resolved.yaml``) as this release reads it: its format checked
    (:func:`slurmvla.formats.run_dir_version`) and migrated."""
    config = run_dir / CONFIG_FILE
    return saved_config(config.read_text(), RUN_DIR, run_dir_version(run_dir), config)


def wants_average(weights: str, checkpoint: Path) -> bool:
    """Whether ``weights`` (``serve.weights``, export's ``--weights``) picks the moving average of
    ``checkpoint``'s weights: ema (its file must be there: :func:`slurmvla.checkpoint.load_model_file` says
    so), or auto where the checkpoint holds one."""
    return weights == "ema" or (weights == "auto" and (checkpoint / EMA_FILE).is_file())


def _one_set_of_weights(cfg: Config, path: Path, what: str) -> None:
    if cfg.serve.weights == "ema":
        raise ValueError(f"serve.weights=ema: {str(path)!r} is {what}, which holds no moving average; serve "
                         "the run directory or checkpoint folder, or leave serve.weights at auto / trained")


def _load_adapted(cfg: Config, state: dict[str, torch.Tensor], step: int, origin: str, device,
                  merge: bool, base: dict | None) -> Loaded:
    """A LoRA run's adapters (and whatever else it trained, and the buffers) onto its base, rebuilt as the
    run built it (the seed, or ``policy.pretrained_path``: the file must still be there). ``merge``: the
    adapters folded into the base weights (same function, plain policy, less compute per call); the
    config then says ``policy.lora.enabled=false``."""
    from slurmvla.engine.materialize import materialize
    from slurmvla.policy.lora import check_base, merge_adapters
    from slurmvla.seeding import seed_everything

    check_base(base, getattr(cfg.policy, "pretrained_path", None), origin)
    seed_everything(cfg.trainer.seed)  # as the trainer built it: the same random draws
    policy = build_policy(cfg.policy, on_meta=True)
    if has_meta_parameters(policy):
        if base and "init_seed" in base:  # the checkpoint's own record of the seed its base was drawn from
            policy.init_seed = int(base["init_seed"])
        materialize(policy, torch.device("cpu"))
    expected = {k: v for k, v in policy.state_dict().items() if k in checkpoint_keys(policy)}
    missing, unexpected = _mismatch(expected, state)
    if missing or unexpected:
        raise ValueError(f"{origin}: the weights do not fit the LoRA policy its config builds ({cfg.policy.name}, "
                         f"policy.lora: rank {cfg.policy.lora.rank}, parts {list(cfg.policy.lora.parts)}); missing: "
                         f"{missing[:5]}, unexpected: {unexpected[:5]}")
    policy.load_state_dict(state, strict=False)
    if merge:
        merge_adapters(policy)
        cfg = dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, lora=dataclasses.replace(
            cfg.policy.lora, enabled=False)))
    return Loaded(policy.to(device).eval(), cfg, step, origin)


def _load_lerobot(path: Path, overrides, device) -> Loaded:
    """LeRobot's own checkpoint directory: its weights (strictly), its statistics and its config."""
    from slurmvla.policy.stats import checkpoint_normalization

    cfg = lerobot_config(path, list(overrides))
    stats, where = checkpoint_normalization(cfg, cfg.policy.state_dim, cfg.policy.action_dim)
    log.info("LeRobot %s checkpoint %s; statistics from %s", cfg.policy.name, path, where)
    policy = build_policy(cfg.policy, stats)
    return Loaded(policy.to(device).eval(), cfg, 0, str(path))


def _without_pretrained(pc):
    from slurmvla.policy.pi0.weights import tokenizer_dir

    if pc.name not in ("pi0", "pi05"):
        return pc
    tokenizer = tokenizer_dir(pc)
    return dataclasses.replace(pc, pretrained_path=None, stats_source="data",
                               tokenizer_path=None if tokenizer is None else str(tokenizer))


def read_config(config_yaml: str, overrides: list[str], where: str) -> Config:
    """The run's config (``where``: the file or metadata it came from, for errors) with ``overrides`` applied. A
    config this version cannot read (written by another version: a key it no longer has, a value of another
    type) fails naming ``where``; a bad override fails naming the override."""
    try:
        saved = OmegaConf.create(config_yaml)
    except Exception as e:  # YAML's errors span lines: the first says what
        raise ValueError(f"{where} is not a YAML config ({str(e).strip().splitlines()[0]})") from None
    if not isinstance(saved, DictConfig) or not isinstance(saved.get("policy", {}), (DictConfig, dict)):
        raise ValueError(f"{where} is not a slurmvla run config (no policy / data / trainer sections)")
    check_override_keys(overrides, groups=[], policy_name=(saved.get("policy") or {}).get("name"))
    bad = [o for o in overrides if "=" not in o or o.startswith(("+", "~"))]
    if bad:
        raise ValueError(f"override {bad[0]!r} is not key=value; overrides change the run's config, e.g. "
                         "policy.num_inference_steps=5")
    try:
        merged = OmegaConf.merge(saved, OmegaConf.from_dotlist(overrides))
    except Exception as e:
        raise ValueError(f"{where}: the config cannot take the overrides {overrides} ({explain_config_error(e) or e})") \
            from None
    try:
        return to_config(merged)
    except ValueError as e:
        error = e
    if overrides:  # the file's fault or the overrides'? The file alone tells (only on this error path).
        try:
            to_config(saved)
        except ValueError as e:
            error = e
        else:
            raise error
    raise ValueError(f"{where}: {error} (written by another version of slurmvla, or edited? fix or remove that key "
                     "there)") from None


def _mismatch(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    unexpected += sorted(k for k in set(expected) & set(found) if expected[k].shape != found[k].shape)
    return missing, unexpected
