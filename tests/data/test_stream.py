"""The episode-shuffle stream, mixtures and the validation split, against counts taken from the files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from slurmvla.data.datasets import EpisodeStream
from slurmvla.data.loader import TrainData, build_validation_loader
from slurmvla.data.mixture import Mixture
from tests.conftest import policy_spec


def _mixture(cfg, seed=0):
    return Mixture(cfg.data, policy_spec(cfg, image_size=32, text_len=24), seed)


def _episode_lengths(root):
    table = pa.concat_tables([pq.read_table(p, columns=["episode_index"]) for p in sorted((root / "data").glob("**/*.parquet"))])
    return np.bincount(np.asarray(table["episode_index"]))


def _ids(batch):
    return list(zip(batch["dataset_index"].tolist(), batch["episode_index"].tolist(), batch["frame_index"].tolist()))


@pytest.mark.parametrize("world, workers, batch", [(1, 1, 8), (3, 2, 4), (2, 3, 5)])
def test_shards_cover_the_epoch_once_and_evenly(make_cfg, sample_root, world, workers, batch):
    mixture = _mixture(make_cfg())
    lengths = _episode_lengths(sample_root)
    everything = {(0, e, t) for e, n in enumerate(lengths) for t in range(n)}
    seen, per_shard = [], []
    for rank in range(world):
        stream = EpisodeStream(mixture, batch, rank, world, workers)
        for w in range(workers):
            d, e, t, rep, _ = stream.shard_order(0, rank * workers + w)
            per_shard.append(len(d))
            seen += list(zip(d.tolist(), e.tolist(), t.tolist()))
    assert len(set(per_shard)) == 1 and per_shard[0] % batch == 0, "every shard yields the same whole batches"
    assert len(seen) == len(set(seen)), "no sample twice in an epoch across ranks x workers"
    assert set(seen) <= everything
    left_out = len(everything) - len(seen)
    # The stated bound: fewer than num_shards * (batch + 1) samples per epoch.
    assert left_out == stream.samples_left_out < world * workers * (batch + 1)


def test_order_is_a_pure_function_of_seed_and_epoch(make_cfg):
    cfg = make_cfg()
    a = EpisodeStream(_mixture(cfg), 4, 1, 2, 2).shard_order(0, 3)
    b = EpisodeStream(_mixture(cfg), 4, 1, 2, 2).shard_order(0, 3)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    c = EpisodeStream(_mixture(cfg), 4, 1, 2, 2).shard_order(1, 3)
    assert not np.array_equal(a[2], c[2])
    d = EpisodeStream(_mixture(cfg, seed=1), 4, 1, 2, 2).shard_order(0, 3)
    assert not np.array_equal(a[2], d[2])


def test_interleaving_decorrelates_neighbouring_samples(make_cfg):
    def same_episode_neighbours(interleave):
        cfg = make_cfg(f"data.interleave_episodes={interleave}")
        d, e, t, rep, piece = EpisodeStream(_mixture(cfg), 8, 0, 1, 1).shard_order(0, 0)
        batches = piece.reshape(-1, 8)
        return float(np.mean(piece[1:] == piece[:-1])), float(np.mean([len(set(b)) for b in batches]))

    sequential, sequential_distinct = same_episode_neighbours(1)
    mixed, mixed_distinct = same_episode_neighbours(6)
    assert sequential > 0.85 and mixed < 0.4, (sequential, mixed)
    assert mixed_distinct >= 3 > sequential_distinct


def test_resume_mid_epoch_yields_exactly_the_next_samples(make_cfg):
    """Through a real DataLoader with 2 worker processes: resuming at batch p yields batches p, p+1, ..."""
    cfg = make_cfg("data.num_workers=2")
    data = TrainData(_mixture(cfg), cfg.data, 4, rank=1, world_size=2, seed=0)
    full = list(data.iterate(epoch=2, batches=0))
    assert len(full) == data.batches_per_epoch
    for p in (1, 2, 5):
        resumed = list(TrainData(_mixture(cfg), cfg.data, 4, rank=1, world_size=2, seed=0).iterate(2, p))
        assert [_ids(b) for b in resumed] == [_ids(b) for b in full[p:]]
        assert all(torch.equal(x["noise"], y["noise"]) and torch.equal(x["images"], y["images"])
                   for x, y in zip(resumed, full[p:]))


def test_every_rank_yields_the_same_number_of_batches(make_cfg):
    cfg = make_cfg("data.num_workers=2")
    counts = [len(list(TrainData(_mixture(cfg), cfg.data, 3, r, 3, 0).iterate(0, 0))) for r in range(3)]
    assert len(set(counts)) == 1 and counts[0] > 0


def test_mixture_weights_set_each_datasets_share(make_cfg, sample_root, sample_root_v21):
    cfg = make_cfg(f"+data.mixture={{sim:{{root:'{sample_root_v21}',weight:3.0}}}}",
                   "data.mixture.sim.control_mode=cartesian_velocity")
    mixture = _mixture(cfg)
    total = sum(_episode_lengths(sample_root)) + sum(_episode_lengths(sample_root_v21))
    plan = mixture.plan(0)
    per_dataset = np.bincount(plan.dataset, weights=plan.count).astype(int)
    assert per_dataset.sum() == total
    assert abs(per_dataset[0] - 0.25 * total) <= 1 and abs(per_dataset[1] - 0.75 * total) <= 1
    # The smaller, up-weighted dataset repeats (with fresh randomness); the other is subsampled.
    assert per_dataset[1] > sum(_episode_lengths(sample_root_v21)) and (plan.repeat[plan.dataset == 1] > 0).any()
    assert (plan.repeat[plan.dataset == 0] == 0).all()
    batch = next(iter(TrainData(mixture, cfg.data, 16, 0, 1, 0).iterate(0, 0)))
    for i, name, mode in zip(batch["dataset_index"].tolist(), batch["dataset_name"], batch["control_mode"]):
        assert (name, mode) == (["droid_sample", "sim"][i], ["joint_position", "cartesian_velocity"][i])


def test_validation_split_is_by_episode_and_the_loader_reads_it_once(make_cfg, sample_root):
    cfg = make_cfg("data.val_fraction=0.25", "data.split_seed=7")
    mixture = _mixture(cfg)
    source = mixture.sources[0]
    train, val = set(source.train_index.episodes.tolist()), set(source.val_index.episodes.tolist())
    assert len(val) == 3 and not train & val and train | val == set(range(12))
    # The split depends on split_seed, not on the training seed.
    assert set(_mixture(cfg, seed=5).sources[0].val_index.episodes.tolist()) == val
    other = _mixture(make_cfg("data.val_fraction=0.25", "data.split_seed=8")).sources[0]
    assert set(other.val_index.episodes.tolist()) != val
    lengths = _episode_lengths(sample_root)
    expected = [(0, e, t) for e in sorted(val) for t in range(lengths[e])]
    loader = build_validation_loader(mixture, cfg.data, batch_size=5)
    got = [i for b in loader for i in _ids(b)]
    assert got == expected and len(expected) % 5 != 0, "ragged last batch kept"
    again = [i for b in build_validation_loader(mixture, cfg.data, batch_size=5) for i in _ids(b)]
    assert again == got
    # Training never sees a validation episode.
    d, e, t, _, _ = EpisodeStream(mixture, 4, 0, 1, 1).shard_order(0, 0)
    assert not set(e.tolist()) & val
    assert build_validation_loader(_mixture(make_cfg()), cfg.data, 5) is None


def test_map_loader_order_does_not_depend_on_world_size(make_cfg):
    cfg = make_cfg("data.loader=map")
    mixture = _mixture(cfg)
    one = next(iter(TrainData(mixture, cfg.data, 4, 0, 1, 0).iterate(0, 0)))
    halves = [next(iter(TrainData(mixture, cfg.data, 2, r, 2, 0).iterate(0, 0))) for r in range(2)]
    assert sorted(_ids(one)) == sorted(_ids(halves[0]) + _ids(halves[1]))


def test_too_small_for_the_layout_is_a_clear_error(make_cfg):
    with pytest.raises(ValueError, match="fewer than one micro-batch of 200 for each of 2 ranks x 2 dataloader workers"):
        EpisodeStream(_mixture(make_cfg()), 200, 0, 2, 2)


def test_persistent_workers_follow_the_position_and_kept_episodes_change_nothing(make_cfg):
    """Workers outlive the epoch and read (epoch, position) from shared memory; episodes they keep
    decoded across epochs give exactly what decoding afresh gives."""
    kept_cfg = make_cfg("data.num_workers=2", "data.stream_cache_episodes=64")
    fresh_cfg = make_cfg("data.num_workers=2", "data.stream_cache_episodes=0")
    kept = TrainData(_mixture(kept_cfg), kept_cfg.data, 4, 0, 1, seed=0)
    fresh = TrainData(_mixture(fresh_cfg), fresh_cfg.data, 4, 0, 1, seed=0)
    a = [list(kept.iterate(epoch, p)) for epoch, p in ((0, 0), (1, 0), (1, 3))]
    b = [list(fresh.iterate(epoch, p)) for epoch, p in ((0, 0), (1, 0), (1, 3))]
    assert [_ids(x) for x in a[0]] != [_ids(x) for x in a[1]], "a new epoch, a new order"
    assert [_ids(x) for x in a[2]] == [_ids(x) for x in a[1][3:]]
    for xs, ys in zip(a, b):
        assert [_ids(x) for x in xs] == [_ids(y) for y in ys]
        assert all(torch.equal(x["images"], y["images"]) and torch.equal(x["noise"], y["noise"]) for x, y in zip(xs, ys))


def test_windowed_pieces_equal_whole_episodes_and_hold_only_their_window(make_cfg, monkeypatch):
    """With a 2-frame history 3 frames apart: every stream sample equals the sample cut from the
    whole decoded episode; each piece's samples come in frame order; an open piece never holds
    more than its history span plus one decode block; a request behind the window is refused."""
    from slurmvla.data.source import EpisodeWindow

    cfg = make_cfg("data.num_obs_history=2", "data.history_interval=3", "policy.num_obs_history=2",
                   "data.stream_cache_episodes=0")
    mixture = Mixture(cfg.data, policy_spec(cfg, image_size=32, text_len=24), 0)
    source = mixture.sources[0]
    held = []
    original = EpisodeWindow.images

    def watched(self, frames):
        out = original(self, frames)
        held.append(self.buffered_frames)
        return out

    monkeypatch.setattr(EpisodeWindow, "images", watched)
    stream = EpisodeStream(mixture, 4, 0, 1, 1)
    d, e, t, rep, piece = stream.shard_order(0, 0)
    for p in np.unique(piece):
        assert np.all(np.diff(t[piece == p]) > 0), "a piece's samples come in frame order"
    whole = {}
    for i, s in enumerate(stream):
        ep, frame = int(s["episode_index"]), int(s["frame_index"])
        assert (ep, frame) == (e[i], t[i])
        if ep not in whole:
            whole[ep] = source.load_episode(ep)
        ref = source.sample(whole[ep], frame, 0, int(rep[i]))
        assert torch.equal(s["images"], ref["images"]) and torch.equal(s["image_mask"], ref["image_mask"])
        assert torch.equal(s["state"], ref["state"]) and torch.equal(s["actions"], ref["actions"])
    assert i + 1 == len(d) and held
    # The blocks that overlap a 4-frame history window: at most two, whatever the episode length.
    assert max(held) <= 2 * EpisodeWindow.BLOCK, max(held)

    window = source.open_episode(int(source.train_index.episodes[0]))
    window.images(np.asarray([10, 13]))
    with pytest.raises(RuntimeError, match="moves forward only"):
        window.images(np.asarray([2, 5]))
    window.close()


def test_a_reader_open_before_a_fork_is_closed_and_freed_in_the_child_without_waiting(sample_root, monkeypatch):
    """Data-loader workers are forked while the parent may hold open readers. An inherited decoder's
    threads exist only in the parent: closing or freeing it in the child waited on them forever
    (holding the GIL, so the whole worker hung). The child must close, drop and collect it at once.
    (The readers decode on one thread now; a threaded decoder is what this protects against.)"""
    import gc
    import multiprocessing

    from slurmvla.data import video

    monkeypatch.setattr(video, "DECODER_THREADS", 0)  # FFmpeg's automatic count: a thread per core
    path = sorted((Path(sample_root) / "videos").glob("**/*.mp4"))[0]
    reader = video.FrameReader(path, 0.0, 20, 15.0, 64)
    reader.read(8)  # the decoder's threads are running

    def child() -> None:
        nonlocal reader
        reader.close()
        reader = None
        gc.collect()

    proc = multiprocessing.get_context("fork").Process(target=child)
    proc.start()
    proc.join(60)
    alive = proc.is_alive()
    if alive:
        proc.kill()
        proc.join()
    reader.close()
    assert not alive and proc.exitcode == 0, "the forked child hung closing a decoder it inherited"


def test_readers_start_no_threads_of_their_own(sample_root):
    """A stream worker holds a reader per camera of each interleaved episode (24 by default). FFmpeg's
    decoder and libswscale each default to a thread per core per reader: thousands of threads per worker
    on a many-core node. The readers decode and convert on the calling thread (the cameras run in
    parallel on read_concurrently's pool instead)."""
    import os

    from slurmvla.data import video

    def threads() -> set[str]:
        return set(os.listdir("/proc/self/task"))

    path = sorted((Path(sample_root) / "videos").glob("**/*.mp4"))[0]
    before = threads()
    readers = [video.FrameReader(path, 0.0, 10, 15.0, size) for size in (None, 64, 64, 48)]
    try:
        for reader in readers:
            reader.read(4)
        started = threads() - before
        assert not started, f"{len(started)} threads started by {len(readers)} readers"
    finally:
        for reader in readers:
            reader.close()


class _FrozenCount(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> int:
        import gc

        return gc.get_freeze_count()


def test_a_data_worker_starts_with_the_parents_objects_frozen():
    """Before a worker is forked the parent's live objects are frozen (slurmvla.data.video._before_fork), so no
    later garbage collection, in the parent or the worker, writes into the pages they share: without it
    the first worker's private memory grew by the parent's objects (benchmarks/vs_lerobot.py, 2 workers:
    84 -> 49 MiB per worker)."""
    import slurmvla.data.video  # noqa: F401  (registers the fork hook, as the data layer always does)

    loader = torch.utils.data.DataLoader(_FrozenCount(), num_workers=1, multiprocessing_context="fork")
    assert int(next(iter(loader))) > 1000


class _ArrowPool(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> str:
        return pa.default_memory_pool().backend_name


def test_a_data_worker_reads_parquet_through_the_system_allocator():
    """A forked worker's Arrow pool is malloc (slurmvla.data.lerobot_format), not the parent's mimalloc, whose
    inherited segments its first reads copied into the worker's private memory; the parent keeps its pool."""
    import slurmvla.data.lerobot_format  # noqa: F401  (registers the fork hook, as the data layer always does)

    parent = pa.default_memory_pool().backend_name
    loader = torch.utils.data.DataLoader(_ArrowPool(), num_workers=1, multiprocessing_context="fork",
                                         collate_fn=lambda items: items[0])
    assert next(iter(loader)) == "system" and pa.default_memory_pool().backend_name == parent
