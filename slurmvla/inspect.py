"""Print what the configured data yields, as JSON, without training.

    python -m slurmvla.inspect [the same overrides as slurmvla.train]
    python -m slurmvla.inspect data.root=/data/droid data.keep_ranges.path=... data.keep_ranges.episode_id_to_path=...
    python -m slurmvla.inspect --scan [overrides]

--scan: check every data file of every dataset instead, each once: every video opened and all its frames
decoded (not converted; threads in parallel; about the time one epoch spends decoding, so minutes to hours
on DROID), every data parquet read whole and the frames of its image cameras (LeRobot's dtype "image")
decoded. Prints each damaged file with its reason and the episodes it holds and exits 1 when there is
any (0 when every file reads): what data.on_damaged=skip would skip.

Per dataset: format version, episodes and frames in total, episodes and frames kept by the filters,
episodes whose keep-ranges key could not be built, samples per epoch under each keep-ranges
semantics (``frame`` / ``window``), train / validation episodes; for the mixture: the sampling
weights and the samples each dataset contributes per epoch. Run it before spending GPU hours.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from slurmvla.compose import compose
from slurmvla.config import Config
from slurmvla.config.data import KEEP_RANGE_SEMANTICS
from slurmvla.errors import FAILED, boundary


def summarize(cfg: Config) -> dict:
    from slurmvla.data.mixture import Mixture
    from slurmvla.data.source import LeRobotSource, dataset_specs
    from slurmvla.data.synthetic import ensure_sample_dataset
    from slurmvla.policy import sample_spec

    ensure_sample_dataset(cfg.data)
    samples = sample_spec(cfg.policy)
    mixture = Mixture(cfg.data, samples, cfg.trainer.seed)
    datasets = mixture.summary()
    for i, spec in enumerate(dataset_specs(cfg.data)):
        entry = datasets[spec.name]
        entry["keep_ranges"] = spec.keep_ranges.path
        if spec.keep_ranges.path is None:
            continue
        # Samples per epoch under each semantics (the configured one is what training uses).
        per_mode = {}
        for semantics in KEEP_RANGE_SEMANTICS:
            other = dataclasses.replace(spec, keep_ranges=dataclasses.replace(spec.keep_ranges, semantics=semantics))
            source = LeRobotSource(other, cfg.data, samples, cfg.trainer.seed, i)
            per_mode[semantics] = {"samples": source.index.num_samples, "train_samples": source.train_index.num_samples}
        entry["samples_by_semantics"] = per_mode
    return {
        "datasets": datasets,
        "mixture": {
            "weights": {name: float(w) for name, w in zip(mixture.names, mixture.weights)},
            "samples_per_epoch": mixture.samples_per_epoch,
            "action_horizon": samples.action_horizon,
            "mode": cfg.data.mode,
            "loader": cfg.data.loader,
        },
    }


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return
    if "--scan" in args:
        from slurmvla.data.damaged import scan
        from slurmvla.data.mixture import Mixture
        from slurmvla.data.synthetic import ensure_sample_dataset
        from slurmvla.policy import sample_spec

        with boundary():
            cfg = compose([a for a in args if a != "--scan"])
            ensure_sample_dataset(cfg.data)
            mixture = Mixture(cfg.data, sample_spec(cfg.policy), cfg.trainer.seed)
            found = scan(mixture.sources)
        for f in found:
            shown = ", ".join(map(str, f.episodes[:20])) + (f", ... ({len(f.episodes)})" if len(f.episodes) > 20 else "")
            print(f"damaged: {f.path}: {f.reason}; {f.dataset} episodes {shown}")
        print(f"{len(found)} damaged file(s)" if found else "every data file reads")
        if found:
            sys.exit(FAILED)
        return
    with boundary():
        summary = summarize(compose(args))
    print(json.dumps(summary, indent=2, default=str))


if __name__ == "__main__":
    main()
