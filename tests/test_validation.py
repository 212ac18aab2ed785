"""Validation by (dataset, control mode): bucketing by hand, and one pass on 1, 2 and 3 gloo ranks
against an independent sample-by-sample computation."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from slurmvla.collectives import gather_dict
from slurmvla.data.datasets import ValidationDataset
from slurmvla.data.loader import build_validation_loader
from slurmvla.data.mixture import Mixture
from slurmvla.policy import build_policy
from slurmvla.validation import bucket, validate
from tests.conftest import policy_spec
from tests.test_collectives import run_spawned


def test_bucket_disaggregates_a_mixed_batch_by_hand():
    # Six samples: datasets a, b, a, c, b, a; control modes x, y, y, x, x, y. Dataset c counts nothing.
    values = {
        "mse/sum": torch.tensor([1.0, 10.0, 3.0, 0.0, 20.0, 5.0], dtype=torch.float64),
        "mse/count": torch.tensor([1.0, 2.0, 3.0, 0.0, 2.0, 1.0], dtype=torch.float64),
        "dataset_index": torch.tensor([0, 1, 0, 2, 1, 0]),
        "control_mode": torch.tensor([0, 1, 1, 0, 0, 1]),
    }
    m = bucket(values, ["a", "b", "c"], ["x", "y"], [0.5, 0.25, 0.25])
    assert m["val/by_dataset/a/mse"] == (1 + 3 + 5) / (1 + 3 + 1)  # Σsum / Σcount, not a mean of means
    assert m["val/by_dataset/b/mse"] == (10 + 20) / 4
    assert "val/by_dataset/c/mse" not in m and not any(math.isnan(v) for v in m.values())
    assert m["val/by_control_mode/x/mse"] == (1 + 20) / 3  # the zero-count sample adds nothing
    assert m["val/by_control_mode/y/mse"] == (10 + 3 + 5) / 6
    # The aggregate weights each present dataset's mean by its mixture weight (c is absent).
    assert m["val/mse"] == pytest.approx((0.5 * 9 / 5 + 0.25 * 30 / 4) / 0.75)
    assert m["val/loss"] == m["val/mse"] and m["val/num_samples"] == 6


def _gather_ragged(rank):
    count = [3, 1, 0][rank]
    n = 4
    values = {"x": torch.arange(n, dtype=torch.float64) + 10 * rank, "y": -torch.arange(n, dtype=torch.float64)}
    return gather_dict(values, count)


def test_gather_dict_drops_the_same_padding_from_every_entry(tmp_path):
    out = run_spawned(_gather_ragged, 3, tmp_path)
    assert out[1] is None and out[2] is None
    assert out[0]["x"].tolist() == [0, 1, 2, 10] and out[0]["y"].tolist() == [0, -1, -2, 0]


def _policy(cfg):
    torch.manual_seed(0)
    return build_policy(cfg.policy)


def _validate_on_rank(rank, cfg, world):
    mixture = Mixture(cfg.data, policy_spec(cfg), 0)
    loader = build_validation_loader(mixture, cfg.data, 4, rank, world)
    return validate(_policy(cfg), loader, torch.device("cpu"), mixture)


@pytest.fixture(scope="module")
def mixed_cfg(sample_root, sample_root_v21):
    from slurmvla.compose import compose

    return compose([
        f"data.root={sample_root}", "data.num_workers=0", "data.val_fraction=0.3", "data.weight=2.0",
        f"+data.mixture={{sim:{{root:'{sample_root_v21}',control_mode:cartesian_velocity}}}}",
        "logging.wandb.mode=disabled", "policy.image_size=32"])


@pytest.mark.multiproc
def test_the_same_metrics_on_1_2_and_3_ranks_as_sample_by_sample(mixed_cfg, tmp_path):
    cfg = mixed_cfg
    mixture = Mixture(cfg.data, policy_spec(cfg, image_size=32), 0)
    dataset = ValidationDataset(mixture)
    assert len(dataset) % 4 and len(dataset) % 3, "a ragged last batch and unequal rank shares"
    # Independent reference: every validation sample alone, summed per dataset and control mode.
    policy = _policy(cfg).eval()
    sums: dict[str, list[float]] = {}
    with torch.no_grad():
        for i in range(len(dataset)):
            s = dataset[i]
            batch = {k: (v[None] if isinstance(v, torch.Tensor) else [v]) for k, v in s.items()}
            total, count = (x.item() for x in policy(batch)["components"]["mse"])
            for key in (f"by_dataset/{s['dataset_name']}", f"by_control_mode/{s['control_mode']}"):
                acc = sums.setdefault(key, [0.0, 0.0])
                acc[0] += total
                acc[1] += count
    expected = {f"val/{k}/mse": t / c for k, (t, c) in sums.items()}
    w = dict(zip(mixture.names, mixture.weights))
    expected["val/mse"] = sum(w[n] * expected[f"val/by_dataset/{n}/mse"] for n in mixture.names)
    results = {}
    for world in (1, 2, 3):
        (tmp_path / str(world)).mkdir()
        out = run_spawned(functools.partial(_validate_on_rank, cfg=cfg, world=world), world, tmp_path / str(world),
                          deadline_s=120)
        assert all(o is None for o in out[1:]), out[1:]
        assert isinstance(out[0], dict), out[0]
        results[world] = out[0]
    for world, metrics in results.items():
        assert metrics["val/num_samples"] == len(dataset)
        assert set(expected) <= set(metrics)
        for key, value in expected.items():
            assert metrics[key] == pytest.approx(value, rel=1e-5), (world, key)
        for key, value in results[1].items():
            assert metrics[key] == pytest.approx(value, rel=1e-6), (world, key)


def test_validation_reads_in_order_through_windows_and_any_order_gives_the_same_samples(mixed_cfg):
    """The validation reader decodes each episode forward through one window; reading its indices
    backwards (a new window each time) or cutting samples from whole decoded episodes gives the same
    samples."""
    mixture = Mixture(mixed_cfg.data, policy_spec(mixed_cfg, image_size=32), 0)
    forward = ValidationDataset(mixture)
    order = list(range(len(forward)))
    a = [forward[i] for i in order]
    backward = ValidationDataset(mixture)
    b = [backward[i] for i in reversed(order)][::-1]
    whole = {}
    for i, (x, y) in enumerate(zip(a, b)):
        d, e, t = (int(v) for v in forward.rows[i])
        if (d, e) not in whole:
            whole[(d, e)] = mixture.sources[d].load_episode(e)
        ref = mixture.sources[d].sample(whole[(d, e)], t, ValidationDataset.EPOCH)
        for s in (x, y):
            assert all(torch.equal(s[k], ref[k]) for k in ("images", "image_mask", "state", "actions", "noise"))
