"""The DROID keep-ranges filter against a by-hand count from the JSON files and the episode table."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from slurmvla.data.droid import DroidDataset
from slurmvla.data.keep_ranges import episode_key, keep_segments, load_keep_ranges


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


def test_segments_by_semantics():
    r = np.array([[2, 10], [20, 23]])
    assert keep_segments(r, 22, 4, "frame").tolist() == [[2, 10], [20, 22]]
    assert keep_segments(r, 30, 4, "window").tolist() == [[2, 7]]  # [20, 23) cannot hold a 4-step chunk


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
    ds = DroidDataset(cfg.data, 32, horizon, 24)
    got = {(ds[i]["episode_index"].item(), ds[i]["frame_index"].item()) for i in range(len(ds))}
    assert got == expected and len(ds) == len(expected)
    assert ds.keep_ranges_counts["absent"] > 0 and ds.keep_ranges_counts["unkeyed"] == 0
    if semantics == "window":
        for i in range(0, len(ds), 7):
            assert ds[i]["action_mask"].all()


def test_missing_file_and_unkeyable_dataset_fail_clearly(make_cfg, sample_root, tmp_path):
    with pytest.raises(ValueError, match="data.keep_ranges.path='/nope.json' does not exist"):
        make_cfg("data.keep_ranges.path=/nope.json")
    cfg = make_cfg(f"data.keep_ranges.path={sample_root / 'keep_ranges_1_0_1.json'}",
                   f"data.keep_ranges.episode_id_to_path={sample_root / 'episode_id_to_path.json'}",
                   "data.keep_ranges.episode_id_column=droid_id")
    with pytest.raises(ValueError, match="has no 'droid_id' column.*cannot be filtered"):
        DroidDataset(cfg.data, 32, 8, 24)
