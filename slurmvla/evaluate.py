"""Open-loop evaluation: how close a trained policy's action chunks come to the recorded ones.

    python -m slurmvla.evaluate SOURCE [--split val|all] [--out DIR] [--seed 0] [overrides ...]

``SOURCE``: an exported .safetensors file, a checkpoint folder, a run directory or a LeRobot pi0 / pi0.5
checkpoint directory (with its own statistics; ``data.root=...`` names the episodes). Overrides change
the run's config, e.g. ``data.root=/data/other`` (then ``--split all`` evaluates every episode).

Every sample of the split is run through the policy's own inference path (``sample_actions``) and
compared with the recorded chunk, over the chunk steps inside the episode: MSE per action
dimension (in the dataset's units, and normalized by the data's action scale so dimensions are
comparable; under ``data.delta_actions`` both chunks are turned back into absolute commands first, which
leaves the errors as they are), first-step and whole-chunk error, per dataset and per control mode; plus the
training-time validation loss on the same samples. Written to ``DIR/metrics.json`` with two plots:
``trajectories.png`` (predicted vs recorded actions along a few episodes) and ``error_per_dim.png``.

Fixed seeds: sampling noise is seeded per batch from ``--seed``, the sample order is fixed, so the
same command gives the same numbers.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from slurmvla.cli import ArgumentParser, program
from slurmvla.data.damaged import pop_marks
from slurmvla.data.datasets import SPLITS
from slurmvla.data.loader import build_validation_loader, to_device
from slurmvla.data.mixture import Mixture
from slurmvla.data.prepare import inference_fields
from slurmvla.data.processor import Processor
from slurmvla.errors import boundary
from slurmvla.inference.graphs import inference_sampler
from slurmvla.inference.lerobot_checkpoint import lerobot_type
from slurmvla.inference.load import Loaded, load_exported
from slurmvla.policy.base import seeded_sample_actions
from slurmvla.policy.stats import resolve_stats
from slurmvla.validation import bucket, per_sample

METRICS_FILE = "metrics.json"


@torch.no_grad()
def evaluate(loaded: Loaded, split: str = "val", seed: int = 0, batch_size: int = 16,
             device: str | torch.device = "cpu", cuda_graph: bool = False, compile: bool = False) -> tuple[dict, dict]:
    """``(metrics, per_sample)``: the JSON-ready metrics and, per sample, its provenance, predicted and
    recorded chunk (for plots). ``cuda_graph`` / ``compile``: the predictions through
    :func:`slurmvla.inference.graphs.inference_sampler` (as the server's options)."""
    cfg, policy = loaded.cfg, loaded.policy.to(device).eval()
    sampler = inference_sampler(policy, cuda_graph, compile, "--cuda-graph")
    spec = type(policy).sample_spec(cfg.policy)
    # The samples come prepared by the training path (the same processor, inside the data layer).
    processor = Processor(cfg.data, spec)
    mixture = Mixture(cfg.data, spec, cfg.trainer.seed)
    loader = build_validation_loader(mixture, cfg.data, batch_size, split=split)
    if loader is None:
        raise ValueError(f"split {split!r} of {mixture.names} has no samples (data.val_fraction="
                         f"{cfg.data.val_fraction}); use --split all to evaluate every episode")
    # Errors in normalized units: the policy's own statistics (its buffers), whichever source made them.
    own = getattr(policy, "action_scale", None)
    scale = (own if isinstance(own, torch.Tensor) else resolve_stats(cfg, mixture, announce=False)["action_scale"]) \
        .detach().double().cpu().numpy()
    cols: dict[str, list] = defaultdict(list)
    num_real = loader.dataset.num_real
    seen = 0
    damaged: list[str] = []
    for i, batch in enumerate(loader):
        substitute, files = pop_marks(batch)
        damaged += files
        batch = to_device(batch, device)
        out = policy(batch)
        # What the server would give it, with the noise of this batch's seed (the same on any device).
        pred = seeded_sample_actions(sampler, spec, inference_fields(batch), seed * 1_000_003 + i)
        take = min(len(pred), num_real - seen)
        seen += take
        # Samples standing in for damaged episodes (data.on_damaged=skip) are left out.
        keep = ~substitute[:take].bool()
        for key, value in per_sample(out, batch, mixture.control_modes, torch.float64, take).items():
            cols[key].append(value.cpu()[keep])
        pred, actions = pred[:take].double().cpu(), batch["actions"][:take].double().cpu()
        # Back to the commands the robot would get (data.delta_actions: the same errors; plots in its units).
        state = batch["state"][:take].double().cpu()
        pred, actions = processor.to_commands(pred, state), processor.to_commands(actions, state)
        cols["pred"].append(pred[keep])
        cols["actions"].append(actions[keep])
        cols["mask"].append(batch["action_mask"][:take].cpu()[keep])
        for key in ("episode_index", "frame_index"):  # for the plots: which episode, where along it
            cols[key].append(batch[key][:take].cpu()[keep])
    v = {k: torch.cat(x).numpy() for k, x in cols.items()}
    val = bucket({k: torch.as_tensor(x) for k, x in v.items() if "/" in k or k in ("dataset_index", "control_mode", "mode")},
                 mixture.names, mixture.control_modes, list(mixture.weights))
    names = _dim_names(mixture)
    metrics = {
        "source": loaded.source, "step": loaded.step, "weights": loaded.weights, "split": split, "seed": seed,
        "batch_size": batch_size,
        "num_samples": int(len(v["pred"])), "datasets": mixture.names, "action_dims": names,
        "num_inference_steps": getattr(cfg.policy, "num_inference_steps", None),
        **_errors(v, np.ones(len(v["pred"]), bool), scale, names),
        "by_dataset": {n: _errors(v, v["dataset_index"] == d, scale, names) for d, n in enumerate(mixture.names)
                       if (v["dataset_index"] == d).any()},
        "by_control_mode": {m: _errors(v, v["control_mode"] == c, scale, names)
                            for c, m in enumerate(mixture.control_modes) if (v["control_mode"] == c).any()},
        "validation_loss": {k.removeprefix("val/"): x for k, x in val.items()},
        # Damaged episodes skipped (data.on_damaged=skip): their samples are not in the numbers above.
        "skipped_damaged": damaged,
    }
    return metrics, v


def _errors(v: dict, sel: np.ndarray, scale: np.ndarray, names: list[str]) -> dict:
    """MSE over the valid chunk steps of the selected samples: per dim in data units and normalized,
    for the first step and for the whole chunk."""
    err = (v["pred"][sel] - v["actions"][sel]) ** 2  # [N, H, A]
    mask = v["mask"][sel].astype(np.float64)[:, :, None]  # [N, H, 1]
    chunk = (err * mask).sum(axis=(0, 1)) / mask.sum(axis=(0, 1))
    first = err[:, 0].mean(axis=0)  # the first chunk step is always inside the episode
    return {
        "num_samples": int(sel.sum()),
        "chunk_mse": float((chunk / scale**2).mean()),
        "first_step_mse": float((first / scale**2).mean()),
        "chunk_mse_per_dim": dict(zip(names, map(float, chunk))),
        "first_step_mse_per_dim": dict(zip(names, map(float, first))),
        "chunk_mse_per_dim_normalized": dict(zip(names, map(float, chunk / scale**2))),
        "first_step_mse_per_dim_normalized": dict(zip(names, map(float, first / scale**2))),
    }


def _dim_names(mixture: Mixture) -> list[str]:
    source = mixture.sources[0]
    names = []
    for key in mixture.cfg.action_keys:
        dim = source.meta.feature_dim(key)
        labels = source.meta.features[key].get("names")
        flat = labels if isinstance(labels, list) and len(labels) == dim and all(isinstance(x, str) for x in labels) else None
        names += [f"{key}.{flat[i]}" if flat else f"{key}[{i}]" for i in range(dim)]
    return names


def plot(metrics: dict, v: dict, out: Path, episodes: int = 3) -> list[Path]:
    """``trajectories.png``: for the first ``episodes`` episodes, the recorded action per dim along
    the episode, the predicted first step, and every 4th frame's whole predicted chunk;
    ``error_per_dim.png``: normalized first-step and chunk MSE per dim."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = metrics["action_dims"]
    dims = len(names)
    keys = list(dict.fromkeys(zip(v["dataset_index"].tolist(), v["episode_index"].tolist())))[:episodes]
    fig, axes = plt.subplots(len(keys), dims, figsize=(2.4 * dims, 2.2 * max(1, len(keys))), squeeze=False)
    for r, (d, e) in enumerate(keys):
        sel = np.flatnonzero((v["dataset_index"] == d) & (v["episode_index"] == e))
        sel = sel[np.argsort(v["frame_index"][sel])]
        frames = v["frame_index"][sel]
        for a in range(dims):
            ax = axes[r, a]
            ax.plot(frames, v["actions"][sel, 0, a], color="black", lw=1.2, label="recorded")
            ax.plot(frames, v["pred"][sel, 0, a], color="tab:red", lw=1.0, label="predicted (first step)")
            for j in sel[::4]:
                h = int(v["mask"][j].sum())
                ax.plot(v["frame_index"][j] + np.arange(h), v["pred"][j, :h, a], color="tab:blue", lw=0.5, alpha=0.5)
            if r == 0:
                ax.set_title(names[a], fontsize=7)
            if a == 0:
                ax.set_ylabel(f"{metrics['datasets'][d]} ep {e}", fontsize=7)
            ax.tick_params(labelsize=6)
    axes[0, 0].legend(fontsize=6, loc="best")
    fig.suptitle(f"open-loop actions, step {metrics['step']} (blue: predicted chunks)", fontsize=9)
    fig.tight_layout()
    paths = [out / "trajectories.png", out / "error_per_dim.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(max(5, 0.6 * dims), 3.2))
    x = np.arange(dims)
    ax.bar(x - 0.2, [metrics["first_step_mse_per_dim_normalized"][n] for n in names], 0.4, label="first step")
    ax.bar(x + 0.2, [metrics["chunk_mse_per_dim_normalized"][n] for n in names], 0.4, label="whole chunk")
    ax.set_xticks(x, [n.split(".")[-1] for n in names], rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("MSE (normalized units)")
    ax.set_title(f"{metrics['split']} split, {metrics['num_samples']} samples", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


def default_out(source: str, loaded: Loaded, split: str) -> Path:
    path = Path(source)
    if path.is_file():
        return path.with_name(f"{path.stem}_eval_{split}")
    if lerobot_type(path):  # beside LeRobot's directory, not inside it
        return path.resolve().with_name(f"{path.resolve().name}_eval_{split}")
    checkpoint = Path(loaded.source)
    return checkpoint.parent.parent / "eval" / f"{checkpoint.name}_{split}"


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog=program("slurmvla.evaluate"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="an exported .safetensors file, a checkpoint folder, a run directory or a "
                                           "LeRobot pi0 / pi0.5 checkpoint directory")
    parser.add_argument("--split", default="val", help=f"which samples: {' or '.join(SPLITS)} (default val)")
    parser.add_argument("--out", help="output folder (default: RUN_DIR/eval/<checkpoint>_<split>)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling noise (default 0)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--plot-episodes", type=int, default=3, help="episodes in trajectories.png (0: no plots)")
    parser.add_argument("--device", default="auto", help="auto (the GPU when there is one), cpu or cuda")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="predict through CUDA graphs of sample_actions (a GPU; pi0 / pi0.5), as serve.cuda_graph")
    parser.add_argument("--compile", action="store_true", help="torch.compile the policy's repeated layers first")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. data.root=/data/other")
    args = parser.parse_intermixed_args(argv)
    # A DataError may come from a dataloader worker (its traceback as its message): one line all the same.
    with boundary():
        if args.split not in SPLITS:
            raise ValueError(f"--split={args.split!r} is not valid; choose one of {list(SPLITS)}")
        if args.batch_size < 1:
            raise ValueError(f"--batch-size={args.batch_size} must be at least 1")
        if args.plot_episodes:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise ValueError("plots need matplotlib: pip install -e '.[eval]' (or --plot-episodes 0)") from None
        device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
        loaded = load_exported(args.source, args.overrides)
        metrics, values = evaluate(loaded, args.split, args.seed, args.batch_size, device, args.cuda_graph, args.compile)
    out = Path(args.out) if args.out else default_out(args.source, loaded, args.split)
    out.mkdir(parents=True, exist_ok=True)
    (out / METRICS_FILE).write_text(json.dumps(metrics, indent=2) + "\n")
    written = [out / METRICS_FILE]
    if args.plot_episodes:
        written += plot(metrics, values, out, args.plot_episodes)
    print(f"{metrics['num_samples']} samples ({args.split}): chunk MSE {metrics['chunk_mse']:.4f}, first step "
          f"{metrics['first_step_mse']:.4f} (normalized); validation loss "
          f"{metrics['validation_loss'].get('loss', float('nan')):.4f}")
    if metrics["skipped_damaged"]:
        print(f"skipped {len(metrics['skipped_damaged'])} damaged episode(s) (data.on_damaged=skip): "
              + "; ".join(metrics["skipped_damaged"]))
    for path in written:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
