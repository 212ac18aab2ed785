"""Export a checkpoint as one full fp32 safetensors file, whatever engine wrote it.

    python -m slurmvla.export CHECKPOINT_OR_RUN_DIR OUT.safetensors

The file's metadata carries the step, the engine and, when the run directory has it, the resolved
config, so the policy can be rebuilt without the run directory.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from safetensors.torch import save_file

from slurmvla.checkpoint import META_FILE, load_model_file, resolve_checkpoint


def export(source: str | Path, out: str | Path) -> Path:
    checkpoint = resolve_checkpoint(source)
    state = load_model_file(checkpoint)
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    meta = json.loads((checkpoint / META_FILE).read_text())
    metadata = {"step": str(meta["step"]), "engine": meta["engine"], "source": str(checkpoint.resolve())}
    config = checkpoint.parent.parent / "config.resolved.yaml"
    if config.is_file():
        metadata["config_yaml"] = config.read_text()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata=metadata)
    tmp.replace(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a checkpoint folder, or a run directory (its newest checkpoint)")
    parser.add_argument("out", help="the .safetensors file to write")
    args = parser.parse_args(argv)
    try:
        out = export(args.source, args.out)
    except ValueError as e:
        parser.error(str(e))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
