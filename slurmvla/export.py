"""Export a checkpoint as one full fp32 safetensors file, whatever engine wrote it, and load it back.

    python -m slurmvla.export CHECKPOINT_OR_RUN_DIR OUT.safetensors
    python -m slurmvla.export CHECKPOINT_OR_RUN_DIR OUT_DIR --layout lerobot    # pi0 / pi0.5 for LeRobot 0.6.1
    python -m slurmvla.export CHECKPOINT_OR_RUN_DIR OUT.safetensors --weights trained   # not the moving average
    python -m slurmvla.export LORA_RUN_DIR OUT.safetensors --adapters           # a LoRA run's adapters alone (default: merged)

A run with ``trainer.ema_decay`` is exported with the moving average of its weights, as serving it does
(``serve.weights=auto``); ``--weights trained`` or ``--weights ema`` chooses. The file's metadata carries
the step, the engine, which weights, the exported-file format (``slurmvla_format``: slurmvla/formats.py) and,
when the run directory has it, the resolved config (in this release's form: an older run's is migrated), so the
policy can be rebuilt without the run directory: the server and the evaluator load such a file (or a run
directory / checkpoint folder) with its config alone. A LeRobot pi0 / pi0.5
checkpoint directory is a source too: its weights, statistics and config, loaded strictly.

    python -m slurmvla.export LEROBOT_DIR OUT.safetensors policy.tokenizer_path=PALIGEMMA_DIR
"""


from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from slurmvla.checkpoint import LORA_BASE, load_model_file, read_meta, resolve_checkpoint
from slurmvla.cli import ArgumentParser, program
from slurmvla.config.serve import SERVED_WEIGHTS
from slurmvla.errors import boundary
from slurmvla.formats import EXPORT, EXPORT_KEY
from slurmvla.inference.lerobot_checkpoint import lerobot_type, not_lerobot_reason
from slurmvla.inference.load import CONFIG_FILE, Loaded, load_exported, read_config, run_config, wants_average


def export(source: str | Path, out: str | Path, overrides: list[str] | tuple[str, ...] = (), ema: bool | None = None,
           adapters: bool = False) -> Path:
    """``source`` as one fp32 file. ``overrides`` are read for a LeRobot checkpoint directory only (its
    size when it is not a published one, its tokenizer): a slurmvla checkpoint is written as it is.
    ``ema``: the checkpoint's moving average of the weights (``trainer.ema_decay``) instead of them; None:
    the average where the checkpoint holds one (``serve.weights=auto``: what serving the run would load).
    A LoRA run's checkpoint is written merged (the plain policy, which loads without peft) unless
    ``adapters``: then the adapters and what else it trained alone, small, loaded onto the base its config
    rebuilds."""
    if lerobot_type(source):
        if ema:
            raise ValueError(f"--ema: {str(source)!r} is a LeRobot checkpoint directory, which holds one set of weights")
        return _export_loaded(load_exported(source, overrides), out)
    if overrides:
        raise ValueError(f"overrides {list(overrides)} apply to a LeRobot checkpoint directory; {str(source)!r} is "
                         "a slurmvla checkpoint, exported as it was trained (give overrides to serve or evaluate)")
    if not Path(source).is_dir():
        what = "does not exist" if not Path(source).exists() else "is a file"
        raise ValueError(f"{str(source)!r} {what}; give a checkpoint folder, a run directory or a LeRobot pi0 / pi0.5 "
                         "checkpoint directory")
    if reason := not_lerobot_reason(source):
        raise ValueError(reason)
    checkpoint = resolve_checkpoint(source)
    if ema is None:
        ema = wants_average("auto", checkpoint)
    meta = read_meta(checkpoint)
    metadata = {"step": str(meta["step"]), "engine": meta["engine"], "source": str(checkpoint.resolve()),
                "weights": "moving average" if ema else "trained"}
    config = checkpoint.parent.parent / CONFIG_FILE
    if config.is_file():
        metadata["config_yaml"] = run_config(config.parent)  # in this release's form (an older run's migrated)
    lora = config.is_file() and read_config(metadata["config_yaml"], [], str(config)).policy.lora.enabled
    if lora and not adapters:
        # A LoRA run: its adapters folded into the base it was trained on, written as the plain policy.
        loaded = load_exported(checkpoint, ema=ema)
        return _export_loaded(loaded, out, {**metadata, "lora": "merged"})
    state = load_model_file(checkpoint, ema=ema)
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    if adapters:
        if not lora:
            raise ValueError(f"--adapters: checkpoint {checkpoint} is not from a LoRA run (policy.lora.enabled=false "
                             f"in {config}); export its weights without --adapters")
        metadata["lora"] = "adapters"
        if LORA_BASE in meta:
            metadata[LORA_BASE] = json.dumps(meta[LORA_BASE])
    return _write(state, metadata, out)


def _export_loaded(loaded: Loaded, out: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """A loaded policy (e.g. a LeRobot checkpoint directory's) as a self-contained slurmvla file."""
    config_dict = dataclasses.asdict(loaded.cfg)
    state = {k: v.detach().float().cpu() if v.is_floating_point() else v.cpu()
             for k, v in loaded.policy.state_dict().items()}
    metadata = {"step": str(loaded.step), "engine": "none", "source": loaded.source, **(metadata or {}),
                "config_yaml": OmegaConf.to_yaml(config_dict)}
    return _write(state, metadata, out)


def _write(state: dict[str, torch.Tensor], metadata: dict[str, str], out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    metadata = {**metadata, EXPORT_KEY: str(EXPORT.current)}  # the format this release writes (slurmvla/formats.py)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata=metadata)
    tmp.replace(out)
    return out


LEROBOT_SIDE_FILES = ("config.json", "policy_preprocessor.json", "policy_postprocessor.json")


def export_lerobot(source: str | Path, out: str | Path, overrides: list[str] | tuple[str, ...] = (),
                   ema: bool | None = None) -> Path:
    """A pi0 / pi0.5 checkpoint as a LeRobot 0.6.1 checkpoint directory: ``model.safetensors`` with
    every key LeRobot's PI0Policy / PI05Policy holds (it loads with ``strict=True``), plus LeRobot's
    config and processor files when the run started from a LeRobot checkpoint directory."""
    from slurmvla.policy.pi0.weights import lerobot_state_dict

    loaded = load_exported(source, overrides, ema=ema)
    pc = loaded.cfg.policy
    if pc.name not in ("pi0", "pi05"):
        raise ValueError(f"--layout lerobot writes pi0 / pi0.5 checkpoints; this run's policy is {pc.name!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = lerobot_state_dict(loaded.policy, pc.pretrained_path)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt", "source": loaded.source})
    origin = Path(pc.pretrained_path).expanduser() if pc.pretrained_path else None
    if origin is not None and origin.is_dir():
        import shutil

        for f in [*(origin / n for n in LEROBOT_SIDE_FILES), *origin.glob("policy_*processor*.safetensors")]:
            if f.is_file():
                shutil.copy(f, out / f.name)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog=program("slurmvla.export"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a checkpoint folder, a run directory (its newest checkpoint), or a LeRobot "
                                           "pi0 / pi0.5 checkpoint directory")
    parser.add_argument("out", help="the .safetensors file to write (--layout lerobot: a directory)")
    parser.add_argument("--layout", choices=("slurmvla", "lerobot"), default="slurmvla",
                        help="lerobot: a LeRobot 0.6.1 pi0 / pi0.5 checkpoint directory (strict-loadable)")
    parser.add_argument("--weights", choices=SERVED_WEIGHTS, default="auto",
                        help="ema: the moving average of the weights the checkpoint holds (trainer.ema_decay); "
                             "trained: the optimizer's own; auto (the default): the average where there is one, "
                             "as serving the run does (serve.weights)")
    parser.add_argument("--ema", action="store_true", help="the same as --weights ema")
    parser.add_argument("--adapters", action="store_true",
                        help="a LoRA run: its adapters alone (small; serve and evaluate rebuild the base), not merged")
    parser.add_argument("overrides", nargs="*", help="for a LeRobot source: e.g. policy.tokenizer_path=DIR")
    args = parser.parse_intermixed_args(argv)
    ema = True if args.ema else {"auto": None, "trained": False, "ema": True}[args.weights]
    with boundary():
        if args.ema and args.weights == "trained":
            raise ValueError("--ema and --weights trained contradict each other: give one")
        if args.adapters and args.layout != "slurmvla":
            raise ValueError("--adapters writes slurmvla's layout; --layout lerobot writes the merged weights")
        if args.layout == "slurmvla":
            out = export(args.source, args.out, args.overrides, ema=ema, adapters=args.adapters)
        else:
            out = export_lerobot(args.source, args.out, args.overrides, ema=ema)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
