"""data.augment=openpi against openpi's own augmax chain (golden files), its random draws, and where it applies:
training samples only, the same for the same (seed, epoch, sample), drawn after the policy's randomness."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from slurmvla.compose import compose
from slurmvla.data.augment import NUM_PARAMS, Augmenter, augment, augment_float, crop_size, draw_params
from slurmvla.data.loader import TrainData, build_validation_loader
from slurmvla.data.mixture import Mixture
from slurmvla.data.source import LeRobotSource, dataset_specs, seeded_int
from tests.conftest import policy_spec

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "openpi_augment"
CASES = json.loads((GOLDEN / "meta.json").read_text())["cases"]
PARAM_KEYS = ("crop_dy", "crop_dx", "angle_deg", "jitter", "brightness", "contrast", "hue")
CAMERAS = ["observation.images.exterior_1_left", "observation.images.exterior_2_left", "observation.images.wrist_left"]

# In float, both sides sample the same coordinates bilinearly and run the same HSV arithmetic in float32;
# what differs is rounding: the sampling coordinates (~1e-6 pixel: a pixel-to-pixel step of at most 1 moves
# the result as much) and the RGB -> HSV -> RGB round trip (a few ulps of 1). Measured: at most 8e-6.
FLOAT_TOL = 5e-5
# The data workers keep uint8 images: rounding to the nearest of 255 levels adds at most half a level.
UINT8_TOL = 0.5 / 255 + FLOAT_TOL


def _golden(name):
    z = np.load(GOLDEN / f"{name}.npz")
    params = torch.tensor([[float(z[k]) for k in PARAM_KEYS]])
    return z, params, torch.tensor([not bool(z["wrist"])])


@pytest.mark.parametrize("name", CASES)
def test_matches_openpis_augmax_chain_at_fixed_draws(name):
    z, params, geometric = _golden(name)
    expected = (z["output"].astype(np.float64) + 1) / 2  # openpi's [-1, 1] to [0, 1]
    image = torch.from_numpy(z["image"])[None]
    x = augment_float(image.permute(0, 3, 1, 2).float() / 255.0, params, geometric)[0].permute(1, 2, 0).numpy()
    assert np.abs(x - expected).max() < FLOAT_TOL
    out = augment(image, params, geometric)[0].numpy().astype(np.float64) / 255.0
    assert out.shape == expected.shape
    assert np.abs(out - expected).max() < UINT8_TOL
    # Not the identity: the case moved or recoloured the image well past the tolerance.
    assert np.abs(z["image"] / 255.0 - expected).max() > 0.05


def test_augmax_saturation_has_no_effect_and_jitter_off_keeps_colours():
    """augmax 0.4.1 drops its saturation change: the two wrist cases differ in it and match at none.
    With the jitter's coin at 0 a wrist image comes back as it went in, bit for bit."""
    z, params, geometric = _golden("wrist")
    assert float(z["saturation"]) != 0
    image = torch.from_numpy(z["image"])[None]
    params[0, 3] = 0.0
    assert torch.equal(augment(image, params, geometric), image)


def test_draws_cover_openpis_ranges_uniformly():
    """200,000 draws from one seed (deterministic): each parameter inside its range, spread over it evenly,
    the jitter's coin fair; a wrist camera's geometry always zero."""
    n, height, width = 200_000, 224, 224
    g = torch.Generator().manual_seed(1234)
    p = draw_params(g, [False] * n, height, width).double()
    limit = (height - crop_size(height)) / 2
    assert crop_size(224) == 212 and limit == 6.0
    ranges = {0: limit, 1: limit, 2: 5.0, 4: 0.3, 5: 0.4, 6: 0.1}
    for column, half in ranges.items():
        values = p[:, column]
        assert values.abs().max() <= half and values.abs().max() > 0.999 * half
        # Uniform on [-half, half]: 20 equal bins each hold n / 20 within 5 standard deviations of a binomial.
        counts = torch.histc(values, bins=20, min=-half, max=half)
        expected = n / 20
        assert (counts - expected).abs().max() < 5 * math.sqrt(expected * (1 - 1 / 20)), (column, counts)
        assert abs(values.mean()) < 5 * half / math.sqrt(3 * n)
    coin = p[:, 3]
    assert set(coin.unique().tolist()) == {0.0, 1.0}
    assert abs(coin.mean() - 0.5) < 5 * 0.5 / math.sqrt(n)
    wrist = draw_params(torch.Generator().manual_seed(7), [True] * 1000, height, width)
    assert (wrist[:, :3] == 0).all() and wrist[:, 4:].abs().amax(0).gt(0).all()
    # Non-square frames (DROID's 180 x 320, as pi0 / pi0.5 receive them): the crop keeps 95 % of each side.
    q = draw_params(torch.Generator().manual_seed(8), [False] * 10_000, 180, 320)
    assert q[:, 0].abs().max() <= (180 - 171) / 2 and q[:, 1].abs().max() <= (320 - 304) / 2
    assert q[:, 1].abs().max() > 7.9


def test_wrist_cameras_are_never_cropped_or_rotated():
    """Through the Augmenter: a wrist camera's image differs from its input only where its jitter's coin
    came up (the same image recoloured pixel by pixel), an exterior one is resampled whatever the coin."""
    augmenter = Augmenter("openpi", CAMERAS, None)
    assert augmenter.wrist == [False, False, True]
    assert Augmenter("openpi", CAMERAS, [CAMERAS[0]]).wrist == [True, False, False]
    images = torch.randint(0, 256, (3, 40, 40, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, dtype=torch.bool)
    g = torch.Generator().manual_seed(5)
    kept_wrist = moved_exterior = 0
    for _ in range(40):
        state = g.get_state()
        out = augmenter(images, mask, g)
        replay = torch.Generator()
        replay.set_state(state)
        params = draw_params(replay, augmenter.wrist, 40, 40)
        if params[2, 3] == 0:
            assert torch.equal(out[2], images[2])
            kept_wrist += 1
        else:  # recoloured, not moved: a pixel's colour depends on that pixel alone
            flat_in, flat_out = images[2].reshape(-1, 3), out[2].reshape(-1, 3)
            same_in = (flat_in[:, None] == flat_in[None]).all(-1)
            assert (flat_out[:, None] == flat_out[None]).all(-1)[same_in].all()
        if params[0, 3] == 0:
            assert not torch.equal(out[0], images[0])
            moved_exterior += 1
    assert kept_wrist > 5 and moved_exterior > 5


def test_masked_images_are_left_alone_but_draw_the_same():
    augmenter = Augmenter("openpi", CAMERAS, None)
    images = torch.randint(0, 256, (6, 24, 24, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    full = augmenter(images, torch.ones(6, dtype=torch.bool), torch.Generator().manual_seed(3))
    mask = torch.tensor([True, False, True, False, True, True])
    part = augmenter(images, mask, torch.Generator().manual_seed(3))
    assert torch.equal(part[~mask], images[~mask]) and torch.equal(part[mask], full[mask])
    # A history of two steps: each camera's draw is shared by its two steps.
    params = draw_params(torch.Generator().manual_seed(3), augmenter.wrist, 24, 24)
    twice = images[:3].repeat(2, 1, 1, 1)
    out = augmenter(twice, torch.ones(6, dtype=torch.bool), torch.Generator().manual_seed(3))
    assert torch.equal(out[:3], out[3:]) and torch.equal(out[:3], augment(images[:3], params, ~torch.tensor(augmenter.wrist)))


def test_bad_choices_are_one_clear_line(make_cfg):
    with pytest.raises(ValueError, match=r"data.augment='crop' is not valid; choose one of \['none', 'openpi'\]"):
        make_cfg("data.augment=crop")
    with pytest.raises(ValueError, match="data.augment_wrist_cameras names 'observation.images.wrist', which is not"):
        make_cfg("data.augment=openpi", "data.augment_wrist_cameras=[observation.images.wrist]")


def _source(cfg, seed=3):
    return LeRobotSource(dataset_specs(cfg.data)[0], cfg.data, policy_spec(cfg, 32, 8, 24), seed)


def test_a_training_sample_is_augmented_from_its_own_generator_after_the_policys_draws(make_cfg):
    plain, aug = _source(make_cfg()), _source(make_cfg("data.augment=openpi"))
    ep_plain, ep_aug = plain.load_episode(2), aug.load_episode(2)
    for t in (0, 7):
        a = aug.sample(ep_aug, t, epoch=1, train=True)
        b = plain.sample(ep_plain, t, epoch=1, train=True)
        # Everything but the images is the plain sample's: the policy's draws come first.
        assert all(torch.equal(a[k], b[k]) for k in b if isinstance(b[k], torch.Tensor) and k != "images")
        # Replay: the sample's generator, the policy's draws, then the augmentation's (an independent replay).
        g = torch.Generator().manual_seed(seeded_int(3, 1, 0, 2, t, 0) % 2**63)
        plain.sample_spec.draw(g)
        params = draw_params(g, [False, False, True], 32, 32)
        assert torch.equal(a["images"], augment(b["images"], params, torch.tensor([True, True, False])))
        assert not torch.equal(a["images"], b["images"])
        # Same (seed, epoch, sample): the same augmentation, from a source built anew; another epoch: another.
        again = _source(make_cfg("data.augment=openpi"))
        assert torch.equal(again.sample(again.load_episode(2), t, epoch=1, train=True)["images"], a["images"])
        assert not torch.equal(aug.sample(ep_aug, t, epoch=2, train=True)["images"], a["images"])
        # Not a training read (validation, the checker, evaluation): the frames as decoded.
        assert torch.equal(aug.sample(ep_aug, t, epoch=1)["images"], b["images"])


def test_training_batches_are_augmented_and_validation_batches_never(make_cfg):
    over = ["data.val_fraction=0.25", "data.num_workers=0"]
    cfgs = {name: make_cfg(*over, f"data.augment={name}") for name in ("none", "openpi")}
    mixtures = {name: Mixture(cfg.data, policy_spec(cfg, image_size=32, text_len=24), 0) for name, cfg in cfgs.items()}
    val = {name: list(build_validation_loader(m, cfgs[name].data, 4)) for name, m in mixtures.items()}
    assert len(val["none"]) > 0
    for x, y in zip(val["none"], val["openpi"]):
        assert torch.equal(x["images"], y["images"]) and torch.equal(x["noise"], y["noise"])
    train = {name: next(iter(TrainData(m, cfgs[name].data, 4, 0, 1, 0).iterate(0, 0))) for name, m in mixtures.items()}
    assert torch.equal(train["none"]["frame_index"], train["openpi"]["frame_index"])
    assert torch.equal(train["none"]["noise"], train["openpi"]["noise"])
    assert not torch.equal(train["none"]["images"], train["openpi"]["images"])


def test_resume_mid_epoch_yields_the_same_augmented_images(make_cfg):
    """Through a real DataLoader with 2 worker processes: resumed at batch p, the images (augmented in the
    workers) are the uninterrupted run's."""
    cfg = make_cfg("data.num_workers=2", "data.augment=openpi")

    def data():
        return TrainData(Mixture(cfg.data, policy_spec(cfg, image_size=32, text_len=24), 0), cfg.data, 4, rank=1,
                         world_size=2, seed=0)

    full = list(data().iterate(epoch=1, batches=0))
    resumed = list(data().iterate(1, 3))
    assert len(resumed) == len(full) - 3 > 0
    assert all(torch.equal(x["images"], y["images"]) and torch.equal(x["frame_index"], y["frame_index"])
               for x, y in zip(resumed, full[3:]))


def test_the_pi05_droid_recipe_augments():
    cfg = compose(["experiment=pi05_droid", "data.root=/d", "policy.pretrained_path=/ckpt"])
    augmenter = Augmenter(cfg.data.augment, cfg.data.cameras, cfg.data.augment_wrist_cameras)
    assert augmenter.wrist == [False, True]
    assert NUM_PARAMS == len(PARAM_KEYS)
