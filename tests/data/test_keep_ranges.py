"""The DROID keep-ranges filter against a by-hand count from the JSON files and the episode table."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from slurmvla.data.index import build_index
from slurmvla.data.keep_ranges import episode_key, load_keep_ranges
from slurmvla.data.source import LeRobotSource, dataset_specs
from tests.conftest import policy_spec


def _write(tmp_path, obj):
    p = tmp_path / "keep.json"
    p.write_text(json.dumps(obj))
    return p


@pytest.mark.parametrize("obj, words", [
    ([[0, 1]], "expected one JSON object"),
    ({"k": [[3, 3]]}, "'k': range [3, 3]"),
    ({"k": [[-1, 3]]}, "'k': range [-1, 3]"),
    ({"k": [[0.5, 3]]}, "'k': range [0.5, 3]"),
    ({"k": [[0, 5], [4, 9]]}, "'k': ranges [0, 5] and [4, 9] overlap"),
    ({"k": 5}, "'k': expected a list"),
])
def test_malformed_files_name_the_key_and_range(tmp_path, obj, words):
    with pytest.raises(ValueError) as e:
        load_keep_ranges(_write(tmp_path, obj))
    assert words in str(e.value)


def test_key_format_is_droids():
    assert episode_key("AUTOLab/success/2023-10-27/Fri_Oct_27") == (
        "gs://xembodiment_data/r2d2/r2d2-data-full/AUTOLab/success/2023-10-27/Fri_Oct_27/recordings/MP4--"
        "gs://xembodiment_data/r2d2/r2d2-data-full/AUTOLab/success/2023-10-27/Fri_Oct_27/trajectory.h5")


@pytest.mark.parametrize("semantics", ["frame", "window"])
def test_dataset_keeps_exactly_the_ranges(make_cfg, sample_root, semantics):
    keep = json.loads((sample_root / "keep_ranges_1_0_1.json").read_text())
    to_path = json.loads((sample_root / "episode_id_to_path.json").read_text())
    episodes = pq.read_table(sample_root / "meta" / "episodes" / "chunk-000" / "file-000.parquet").to_pylist()
    horizon = 8
    expected = set()
    for ep in episodes:
        for s, e in keep.get(episode_key(to_path[ep["episode_id"]]), []):
            last = e if semantics == "frame" else e - horizon + 1
            expected |= {(ep["episode_index"], t) for t in range(s, min(last, ep["length"]))}
    cfg = make_cfg(f"data.keep_ranges.path={sample_root / 'keep_ranges_1_0_1.json'}",
                   f"data.keep_ranges.episode_id_to_path={sample_root / 'episode_id_to_path.json'}",
                   f"data.keep_ranges.semantics={semantics}")
    source = LeRobotSource(dataset_specs(cfg.data)[0], cfg.data, policy_spec(cfg, 32, horizon, 24), 0)
    index = source.index
    eps = np.repeat(index.episodes, index.ep_count[index.episodes])
    k = np.arange(len(eps)) - np.repeat(np.cumsum(index.ep_count[index.episodes]) - index.ep_count[index.episodes],
                                        index.ep_count[index.episodes])
    got = set(zip(eps.tolist(), index.frames_of(eps, k).tolist()))
    assert got == expected and index.num_samples == len(expected)
    assert index.counts["episodes_absent"] > 0 and index.counts["episodes_unkeyed"] == 0
    if semantics == "window":
        for e in index.episodes[:4]:
            ep = source.load_episode(int(e))
            t = int(index.frames_of(np.asarray([e]), np.asarray([index.ep_count[e] - 1]))[0])
            assert source.sample(ep, t, 0)["action_mask"].all()


def _index(tmp_path, ranges, lengths=(10, 10, 10), horizon=4, semantics="frame", keys=("a", "b", "c")):
    parsed = load_keep_ranges(_write(tmp_path, ranges))
    index = build_index(np.asarray(lengths), None, list(keys), parsed, horizon, semantics)
    eps = np.repeat(index.episodes, index.ep_count[index.episodes])
    k = np.arange(len(eps)) - np.repeat(np.cumsum(index.ep_count[index.episodes]) - index.ep_count[index.episodes],
                                        index.ep_count[index.episodes])
    return sorted(zip(eps.tolist(), index.frames_of(eps, k).tolist())), index.counts


def test_edge_cases_by_hand(tmp_path):
    # An empty range list keeps nothing of its episode; an episode missing from the file is dropped;
    # an episode without a key is counted apart.
    samples, counts = _index(tmp_path, {"a": [], "b": [[2, 5]]}, keys=("a", "b", None))
    assert samples == [(1, 2), (1, 3), (1, 4)]
    assert (counts["episodes_kept"], counts["episodes_without_samples"], counts["episodes_unkeyed"],
            counts["episodes_absent"]) == (1, 1, 1, 0)
    samples, counts = _index(tmp_path, {"a": [[0, 3]]})
    assert counts["episodes_absent"] == 2 and samples == [(0, 0), (0, 1), (0, 2)]
    # Ranges touching both episode ends, and one running past the end (clipped).
    assert _index(tmp_path, {"a": [[0, 10]], "b": [[7, 25]], "c": [[0, 1], [9, 10]]})[0] == (
        [(0, t) for t in range(10)] + [(1, 7), (1, 8), (1, 9)] + [(2, 0), (2, 9)])
    # A chunk crossing a range end: kept by "frame" (the start frame is inside), not by "window".
    frame, _ = _index(tmp_path, {"a": [[2, 7]]}, semantics="frame")
    window, counts = _index(tmp_path, {"a": [[2, 7]], "b": [[0, 3]]}, semantics="window")
    assert frame == [(0, t) for t in range(2, 7)]
    assert window == [(0, 2), (0, 3)]  # chunks [2, 6) and [3, 7) fit; [4, 8) would cross 7
    assert counts["episodes_without_samples"] == 1  # "b": a 3-step range holds no 4-step chunk
    # At the episode end under "window": the chunk must fit inside the episode too.
    assert _index(tmp_path, {"a": [[5, 10]]}, semantics="window")[0] == [(0, 5), (0, 6)]


def test_missing_file_and_unkeyable_dataset_fail_clearly(make_cfg, sample_root, tmp_path):
    # The config validates anywhere (a saved config re-validates on another machine); the file is
    # checked where it is opened.
    missing = make_cfg("data.keep_ranges.path=/nope.json")
    with pytest.raises(ValueError, match="data.keep_ranges.path='/nope.json' does not exist"):
        LeRobotSource(dataset_specs(missing.data)[0], missing.data, policy_spec(missing, 32, 8, 24), 0)
    cfg = make_cfg(f"data.keep_ranges.path={sample_root / 'keep_ranges_1_0_1.json'}",
                   f"data.keep_ranges.episode_id_to_path={sample_root / 'episode_id_to_path.json'}",
                   "data.keep_ranges.episode_id_column=droid_id")
    with pytest.raises(ValueError, match="has no 'droid_id' column.*cannot be filtered"):
        LeRobotSource(dataset_specs(cfg.data)[0], cfg.data, policy_spec(cfg, 32, 8, 24), 0)
