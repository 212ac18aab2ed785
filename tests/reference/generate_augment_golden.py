"""Golden outputs of openpi's training image augmentation at fixed parameters (the test oracle of
tests/data/test_augment.py).

Run in the reference environment (never slurmvla's):

    bash tests/reference/make_env_openpi_aug.sh ../openpi_aug
    ../openpi_aug/bin/python tests/reference/generate_augment_golden.py    # writes tests/golden/openpi_augment/

What runs is openpi's own chain, built as ``preprocess_observation(train=True)`` builds it
(src/openpi/models/model.py, Physical-Intelligence/openpi at 15a9616): for a camera whose key has no
"wrist", ``augmax.RandomCrop(int(W * 0.95), int(H * 0.95))``, ``augmax.Resize(W, H)``,
``augmax.Rotate((-5, 5))``; for every camera ``augmax.ColorJitter(brightness=0.3, contrast=0.4,
saturation=0.5)``; in ``augmax.Chain``, on the image scaled from openpi's [-1, 1] to [0, 1] and back.
Only the random draws are fixed: while the chain is traced, ``jax.random.uniform`` and
``jax.random.bernoulli`` answer with the case's values, recognised by what augmax asks for (the crop's
two-element draw, the angle's range in radians, each jitter amount's range, the jitter's probability of
0.5, the rotation's 1.0); every patched answer must be asked for, or the generator fails. Everything that
computes (the coordinate map, map_coordinates' bilinear sampling, RGB <-> HSV, the brightness and
contrast rules) is augmax's.

Inputs are uint8 images converted as openpi's data pipeline does (``x / 255 * 2 - 1``), in
float32; the outputs are openpi's, in [-1, 1]. One ``<case>.npz`` per case: ``image`` uint8 [H, W, 3],
``output`` float32 [H, W, 3], ``wrist`` (bool), ``crop_dy``, ``crop_dx`` (the crop centre's offset from
the image centre in pixels, rows and columns), ``angle_deg``, ``jitter`` (bool), ``brightness``,
``contrast``, ``saturation``, ``hue``; meta.json names the versions.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import json
import math
import sys
from pathlib import Path

import augmax
import jax
import jax.numpy as jnp
import numpy as np

OUT = Path(__file__).resolve().parents[1] / "golden" / "openpi_augment"

# (name, height, width, wrist, crop_dy, crop_dx, angle_deg, jitter, brightness, contrast, saturation, hue).
# The crop offsets lie within what RandomCrop draws: +-(side - int(0.95 side)) / 2.
CASES = [
    ("exterior_a", 24, 32, False, 0.4, -0.7, 3.7, True, 0.21, -0.33, 0.4, 0.07),
    ("exterior_b", 24, 32, False, 1.0, -1.0, -4.9, True, -0.25, 0.37, -0.45, -0.09),
    ("exterior_geometry_only", 40, 56, False, -1.3, 0.9, 2.2, False, 0.28, 0.1, 0.2, 0.03),
    ("exterior_max_crop", 40, 56, False, -1.5, 1.5, 5.0, True, 0.0, 0.0, 0.0, 0.1),
    ("wrist", 24, 32, True, 0.0, 0.0, 0.0, True, 0.12, 0.25, -0.3, 0.05),
    ("wrist_dark_contrast", 24, 32, True, 0.0, 0.0, 0.0, True, -0.3, -0.4, 0.5, -0.1),
    ("exterior_small_amounts", 24, 32, False, -0.2, 0.3, -1.1, True, 0.04, 0.05, 0.1, 0.0),
]


def test_image(height: int, width: int, seed: int) -> np.ndarray:
    """Smooth colour gradients (what interpolation is for) plus noise, with grey, black and saturated
    pixels (HSV's edge cases: no chroma, value 0, value 1)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x / width, y / height, 1 - (x + y) / (width + height)], axis=-1) * 255
    image = np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8)
    image[0, :4] = [128, 128, 128]
    image[1, :4] = 0
    image[2, :4] = [255, 255, 255]
    image[3, :4] = [255, 0, 0]
    image[4, :4] = [10, 200, 200]  # two channels at the maximum: the first is argmax
    return image


@contextlib.contextmanager
def fixed_draws(case: dict):
    """jax.random.uniform / bernoulli answering with the case's values while augmax's chain is traced."""
    real_uniform, real_bernoulli = jax.random.uniform, jax.random.bernoulli
    asked: set[str] = set()
    jitter_amounts = {0.3: "brightness", 0.4: "contrast", 0.5: "saturation", 0.1: "hue"}

    def uniform(key, shape=(), dtype=jnp.float32, minval=0.0, maxval=1.0):
        if tuple(shape) == (2,):  # RandomCrop: the crop centre's offset (rows, columns)
            asked.add("crop")
            return jnp.asarray([case["crop_dy"], case["crop_dx"]], jnp.float32)
        lo = float(minval)
        if math.isclose(lo, math.radians(-5.0)):
            asked.add("angle")
            return jnp.asarray(math.radians(case["angle_deg"]), jnp.float32)
        for strength, name in jitter_amounts.items():
            if math.isclose(lo, -strength):
                asked.add(name)
                return jnp.asarray(case[name], jnp.float32)
        raise AssertionError(f"an unexpected draw: uniform(minval={minval}, maxval={maxval}, shape={shape})")

    def bernoulli(key, p=0.5, shape=None):
        if math.isclose(float(p), 1.0):  # Rotate's probability
            asked.add("rotate_p")
            return jnp.asarray(True)
        if math.isclose(float(p), 0.5):  # ColorJitter's probability
            asked.add("jitter_p")
            return jnp.asarray(case["jitter"])
        raise AssertionError(f"an unexpected draw: bernoulli(p={p})")

    jax.random.uniform, jax.random.bernoulli = uniform, bernoulli
    try:
        yield asked
    finally:
        jax.random.uniform, jax.random.bernoulli = real_uniform, real_bernoulli


def openpi_augment(image_pm1: jnp.ndarray, wrist: bool) -> jnp.ndarray:
    """One image ``[H, W, 3]`` in [-1, 1] through openpi's chain (the body of its per-key loop, unbatched:
    openpi vmaps this over the batch)."""
    image = image_pm1 / 2.0 + 0.5
    transforms = []
    if not wrist:
        height, width = image.shape[0:2]
        transforms += [
            augmax.RandomCrop(int(width * 0.95), int(height * 0.95)),
            augmax.Resize(width, height),
            augmax.Rotate((-5, 5)),
        ]
    transforms += [augmax.ColorJitter(brightness=0.3, contrast=0.4, saturation=0.5)]
    image = augmax.Chain(*transforms)(jax.random.PRNGKey(0), image)
    return image * 2.0 - 1.0


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    fields = ("height", "width", "wrist", "crop_dy", "crop_dx", "angle_deg", "jitter", "brightness", "contrast",
              "saturation", "hue")
    for seed, (name, *values) in enumerate(CASES):
        case = dict(zip(fields, values))
        image = test_image(case["height"], case["width"], seed)
        pm1 = jnp.asarray(image, jnp.float32) / 255.0 * 2.0 - 1.0
        with fixed_draws(case) as asked:
            out = np.asarray(jax.jit(lambda x, w=case["wrist"]: openpi_augment(x, w))(pm1), np.float32)
        expected = {"brightness", "contrast", "saturation", "hue", "jitter_p"}
        if not case["wrist"]:
            expected |= {"crop", "angle", "rotate_p"}
        if asked != expected:
            sys.exit(f"{name}: augmax asked for {sorted(asked)}, the case fixes {sorted(expected)}")
        np.savez_compressed(OUT / f"{name}.npz", image=image, output=out,
                            **{k: np.asarray(case[k]) for k in fields[2:]})
        print(f"{name}: {image.shape}, output in [{out.min():.3f}, {out.max():.3f}]")
    meta = {"openpi": "Physical-Intelligence/openpi 15a9616, src/openpi/models/model.py preprocess_observation",
            "augmax": md.version("augmax"), "jax": md.version("jax"), "jaxlib": md.version("jaxlib"),
            "numpy": md.version("numpy"), "python": sys.version.split()[0], "cases": [c[0] for c in CASES]}
    (OUT / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    main()
