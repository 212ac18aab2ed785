"""data.on_damaged: a damaged video costs the episodes it holds, not the run; ranks stay in step; resume is
bitwise; the share limit stops a wrong copy; inspect --scan lists the damaged files. Against counts taken
from the dataset's own metadata."""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from slurmvla import inspect, train
from slurmvla.checkpoint import list_checkpoints
from slurmvla.data.damaged import DAMAGED, SUBSTITUTE
from slurmvla.data.datasets import EpisodeStream
from slurmvla.data.loader import TrainData, build_validation_loader
from slurmvla.data.mixture import Mixture
from tests.conftest import policy_spec, run_until
from tests.test_errors import fails, restore_signals  # noqa: F401 (a fixture)
from tests.test_train import train as _train

CAMERA = "observation.images.wrist_left"
# 437 samples in the sample data (12 episodes): 23 micro-batches of 19 cover one epoch with none left out.
ONE_EPOCH = ["trainer.global_batch_size=19", "trainer.max_steps=23", "data.stream_cache_episodes=0",
             "checkpoint.every_steps=0", "trainer.log_every_steps=1", "data.max_damaged_share=0.5"]


def _episodes_by_file(root: Path) -> dict[int, list[int]]:
    """The metadata's own word: episode indices per video file index of CAMERA."""
    table = pa.concat_tables([pq.read_table(p, columns=["episode_index", f"videos/{CAMERA}/file_index"])
                              for p in sorted((root / "meta" / "episodes").glob("**/*.parquet"))])
    out: dict[int, list[int]] = {}
    for e, f in zip(table["episode_index"].to_pylist(), table[f"videos/{CAMERA}/file_index"].to_pylist()):
        out.setdefault(f, []).append(e)
    return out


@pytest.fixture(scope="module")
def damaged_root(sample_root, tmp_path_factory) -> tuple[Path, Path, list[int]]:
    """A copy of the sample data whose last video file of one camera is cut in half; (root, file, its episodes)."""
    root = tmp_path_factory.mktemp("damaged") / "data"
    shutil.copytree(sample_root, root)
    last = max(_episodes_by_file(root))
    video = root / "videos" / CAMERA / "chunk-000" / f"file-{last:03d}.mp4"
    with open(video, "r+b") as fh:
        fh.truncate(video.stat().st_size // 2)
    return root, video, sorted(_episodes_by_file(root)[last])


@pytest.fixture(scope="module")
def mid_damaged_root(sample_root, tmp_path_factory) -> tuple[Path, Path, list[int]]:
    """Like damaged_root, but the file opens and its frames decode up to the middle of its first episode,
    whose stream is overwritten with zeros from there: damage met after samples of the episode went out. Without
    the dataset's checksums (as LeRobot's own datasets come), which would refuse the file before its first frame."""
    root = tmp_path_factory.mktemp("mid_damaged") / "data"
    shutil.copytree(sample_root, root, ignore=shutil.ignore_patterns("checksums.json"))
    last = max(_episodes_by_file(root))
    video = root / "videos" / CAMERA / "chunk-000" / f"file-{last:03d}.mp4"
    data = bytearray(video.read_bytes())
    start, end = data.find(b"mdat"), data.find(b"moov")
    lo, hi = start + (end - start) // 2, start + (end - start) * 7 // 10
    data[lo:hi] = bytes(hi - lo)
    video.write_bytes(bytes(data))
    return root, video, sorted(_episodes_by_file(root)[last])


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(damaged_root, tmp_path_factory, request):
    """One epoch on the damaged copy, uninterrupted, with the warnings it logged."""
    from slurmvla.compose import compose

    root, _, _ = damaged_root
    run = tmp_path_factory.mktemp("straight") / "run"
    handler = _Collect()
    logging.getLogger("slurmvla").addHandler(handler)
    try:
        _train(compose(_base(root)), run)
    finally:
        logging.getLogger("slurmvla").removeHandler(handler)
    return run, handler.messages


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _base(root: Path, *more: str) -> list[str]:
    return [f"data.root={root}", "data.num_workers=0", "logging.wandb.mode=disabled", "trainer.progress_bar=false",
            *ONE_EPOCH, *more]


def test_training_skips_the_episodes_of_a_damaged_video_once_each_and_counts_them(damaged_root, straight):
    root, video, episodes = damaged_root
    run, warnings = straight
    skipped = [m for m in warnings if m.startswith("skipping")]
    assert len(skipped) == len(episodes) == 2, skipped
    for e in episodes:
        assert sum(str(video) in m and f"(episode {e} of droid_sample)" in m for m in skipped) == 1, skipped
    records = _records(run)
    assert records[-1]["step"] == 23
    # One epoch, no sample left out: each damaged episode is met once.
    assert sum(r["damaged_episodes"] for r in records) == len(episodes)


def test_a_resumed_run_skips_the_same_episodes_and_ends_bitwise_equal(damaged_root, straight, tmp_path):
    from slurmvla.compose import compose

    root, _, episodes = damaged_root
    first_run, _ = straight
    # Stop right after the first step that met a damaged episode (its later samples still to come).
    met_at = next(r["step"] for r in _records(first_run) if r["damaged_episodes"])
    run = tmp_path / "run"
    _train(compose(_base(root)), run, stop_at=met_at)
    second = _train(compose(_base(root)), run)
    assert second.resumed_from is not None and second.resumed_from.name == f"step_{met_at:08d}"
    a = load_file(str(list_checkpoints(first_run / "checkpoints")[-1] / "model.safetensors"))
    b = load_file(str(list_checkpoints(run / "checkpoints")[-1] / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["damaged_episodes"] for r in _records(run)] == [r["damaged_episodes"] for r in _records(first_run)]
    assert sum(r["damaged_episodes"] for r in _records(run)) == len(episodes)


def test_the_stream_keeps_every_shards_count_and_resumes_exactly_through_workers(mid_damaged_root, make_cfg):
    """Two ranks x two worker processes, a video damaged mid-episode: every rank yields its batches; resumed
    before, at and after the batch that met the damage (a position inside the damaged piece: the resumed
    stream must find the damage again before it), the rest comes bitwise, substitutes included."""
    root, _, episodes = mid_damaged_root
    cfg = make_cfg(f"data.root={root}", "data.num_workers=2", "data.stream_cache_episodes=0",
                   "data.max_damaged_share=0.5")
    mixture = Mixture(cfg.data, policy_spec(cfg, image_size=32, text_len=24), 0)
    whole = {r: list(TrainData(mixture, cfg.data, 4, r, 2, 0).iterate(0, 0)) for r in (0, 1)}
    expected = EpisodeStream(mixture, 4, 0, 2, 2).batches_per_epoch
    assert all(len(b) == expected for b in whole.values())
    met = sum(int(b[DAMAGED].sum()) for r in whole for b in whole[r])
    # Each damaged episode is met once per shard its samples fall in.
    pos = [int(np.flatnonzero(mixture.sources[0].meta.episodes["episode_index"] == e)[0]) for e in episodes]
    stream = EpisodeStream(mixture, 4, 0, 2, 2)
    assert met >= len(episodes) and met == sum(int(np.isin(p, stream.shard_order(0, s)[1])) for p in pos
                                               for s in range(4))
    for rank, batches in whole.items():  # noqa: B007 (the rank found is used below)
        real = torch.cat([b["episode_index"][~b[SUBSTITUTE]] for b in batches])
        # Samples of the first damaged episode went out before its damage was met.
        if bool(torch.cat([b[SUBSTITUTE] for b in batches]).any()) and bool((real == episodes[0]).any()):
            break
    else:
        pytest.fail("no rank yielded samples of the damaged episode before substitutes")
    at = next(i for i, b in enumerate(batches) if int(b[DAMAGED].sum()))
    for p in sorted({max(at - 1, 0), at, at + 1, at + 3} & set(range(expected))):
        resumed = list(TrainData(mixture, cfg.data, 4, rank, 2, 0).iterate(0, p))
        assert len(resumed) == expected - p
        assert sum(int(b[DAMAGED].sum()) for b in resumed) == sum(int(b[DAMAGED].sum()) for b in batches[p:])
        for x, y in zip(resumed, batches[p:]):
            assert torch.equal(x["images"], y["images"]) and torch.equal(x["episode_index"], y["episode_index"])
            assert torch.equal(x["noise"], y["noise"]) and torch.equal(x[SUBSTITUTE], y[SUBSTITUTE])


def test_two_ranks_over_gloo_stay_in_step_past_a_damaged_video(damaged_root, tmp_path):
    from slurmvla.compose import compose
    from slurmvla.policy import sample_spec

    root, video, episodes = damaged_root
    cfg = compose(_base(root, "trainer.global_batch_size=38"))
    mixture = Mixture(cfg.data, sample_spec(cfg.policy), cfg.trainer.seed)
    pos = [int(np.flatnonzero(mixture.sources[0].meta.episodes["episode_index"] == e)[0]) for e in episodes]
    shares = [EpisodeStream(mixture, 19, r, 2, 1).shard_order(0, r)[1] for r in (0, 1)]
    assert np.isin(pos, shares[0]).all() and not np.isin(pos, shares[1]).any(), "the damage is on rank 0's share only"
    run = tmp_path / "run"
    code, log = run_until([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "slurmvla.train", "engine=ddp", *_base(root, "trainer.global_batch_size=38",
                                                                      "trainer.max_steps=11", "data.num_workers=1"),
                           f"hydra.run.dir={run}"], 300, "two ranks with a damaged video")
    assert code == 0, log[-4000:]
    records = _records(run)
    assert records[-1]["step"] == 11 and sum(r["damaged_episodes"] for r in records) == len(episodes)
    assert str(video) in log


@pytest.mark.usefixtures("restore_signals")
def test_too_many_damaged_episodes_stop_the_run_with_one_line(damaged_root, tmp_path, capsys, monkeypatch):
    """python -m slurmvla.train's own entry (in this process): exit 1, one error line, no traceback."""
    root, video, _ = damaged_root
    monkeypatch.setattr(sys, "argv", ["train", *_base(root, "data.max_damaged_share=0.01"),
                                      f"hydra.run.dir={tmp_path / 'run'}"])
    line = fails(capsys, train.cli, "data.max_damaged_share=0.01", str(video), "damaged episodes met")
    assert "Traceback" not in capsys.readouterr().err and line


def test_on_damaged_error_keeps_stopping_at_the_first_damaged_file(damaged_root, make_cfg):
    root, video, _ = damaged_root
    cfg = make_cfg(f"data.root={root}", "data.on_damaged=error", "data.stream_cache_episodes=0")
    data = TrainData(Mixture(cfg.data, policy_spec(cfg, image_size=32, text_len=24), 0), cfg.data, 8, 0, 1, 0)
    with pytest.raises(ValueError, match=str(video)):
        list(data.iterate(0, 0))
    with pytest.raises(ValueError, match=r"data.on_damaged='ignore' is not valid; choose one of \['skip', 'error'\]"):
        make_cfg("data.on_damaged=ignore")


def test_validation_replaces_the_samples_of_damaged_episodes_and_leaves_them_out(damaged_root, make_cfg, caplog):
    from slurmvla.policy import build_policy
    from slurmvla.validation import validate

    root, video, episodes = damaged_root
    cfg = make_cfg(f"data.root={root}", "policy.image_size=32")
    mixture = Mixture(cfg.data, policy_spec(cfg), 0)
    loader = build_validation_loader(mixture, cfg.data, 32, split="all")
    batches = list(loader)
    substitute = torch.cat([b[SUBSTITUTE] for b in batches])
    shown = torch.cat([b["episode_index"] for b in batches])
    lengths = dict(zip(mixture.sources[0].meta.episodes["episode_index"].tolist(),
                       mixture.sources[0].meta.episodes["length"].tolist()))
    damaged_samples = sum(lengths[e] for e in episodes)
    assert int(substitute.sum()) == damaged_samples
    assert not np.isin(shown[substitute].numpy(), episodes).any()
    assert sum(int(b[DAMAGED].sum()) for b in batches) == len(episodes)
    # The pass runs every sample (the same forward passes) and leaves the substitutes out of its metrics.
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="slurmvla"):
        metrics = validate(build_policy(cfg.policy), loader, torch.device("cpu"), mixture)
    assert metrics["val/num_samples"] == sum(lengths.values()) - damaged_samples
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("validation left out")]
    assert len(said) == 1 and str(video) in said[0] and f"{len(episodes)} damaged episode(s)" in said[0]


def test_inspect_scan_lists_exactly_the_damaged_files(damaged_root, sample_root, capsys):
    root, video, episodes = damaged_root
    with pytest.raises(SystemExit) as e:
        inspect.main(["--scan", f"data.root={root}"])
    assert e.value.code == 1
    out = capsys.readouterr().out
    damaged = [line for line in out.splitlines() if line.startswith("damaged: ")]
    assert damaged == [f"damaged: {video}: {damaged[0].split(': ', 2)[2]}"] if damaged else False
    assert damaged[0].endswith(f"episodes {', '.join(map(str, episodes))}")
    inspect.main(["--scan", f"data.root={sample_root}"])
    assert "every data file reads" in capsys.readouterr().out


def test_the_map_loader_serves_deterministic_substitutes(damaged_root, make_cfg):
    root, _, episodes = damaged_root
    cfg = make_cfg(f"data.root={root}", "data.loader=map", "data.max_damaged_share=0.5")
    mixture = Mixture(cfg.data, policy_spec(cfg, image_size=32, text_len=24), 0)
    data = TrainData(mixture, cfg.data, 16, 0, 1, 0)
    whole = list(data.iterate(0, 0))
    assert len(whole) == data.batches_per_epoch
    substitute = torch.cat([b[SUBSTITUTE] for b in whole])
    shown = torch.cat([b["episode_index"] for b in whole])
    assert substitute.any() and not np.isin(shown.numpy(), episodes).any()
    # Every sample of the damaged episodes the epoch draws is a substitute, and no other.
    lengths = dict(zip(mixture.sources[0].meta.episodes["episode_index"].tolist(),
                       mixture.sources[0].meta.episodes["length"].tolist()))
    assert int(substitute.sum()) <= sum(lengths[e] for e in episodes)
    again = list(data.iterate(0, 3))
    for x, y in zip(again, whole[3:]):
        assert torch.equal(x["images"], y["images"]) and torch.equal(x["episode_index"], y["episode_index"])
