"""Training image augmentation (``data.augment``), drawn per sample and applied in the data workers.

``openpi``: what openpi's ``preprocess_observation(train=True)`` does (src/openpi/models/model.py, through
augmax 0.4.1, the version its lock file resolves), per image:

- a camera that is not a wrist camera: augmax's ``RandomCrop(0.95 W, 0.95 H)`` (sides cut to ``int``; the
  crop's centre is uniform and continuous, up to half the cut-off either way), ``Resize`` back to ``H x W``
  and ``Rotate((-5, 5))`` (a uniform angle in degrees), composed into one bilinear resampling of the input
  (augmax composes a chain's geometry into one coordinate map), black outside the image;
- every camera: augmax's ``ColorJitter(brightness=0.3, contrast=0.4, saturation=0.5)`` at its defaults for
  the rest, ``hue=0.1`` and ``p=0.5``: half of the images keep their colours; the others go to HSV, where the
  value takes a brightness ``b`` in [-0.3, 0.3] (GIMP's rule: ``v (1 + b)`` below zero, ``v (1 - b) + b``
  above), then a contrast ``c`` in [-0.4, 0.4] (augmax's invertible piecewise line of slope
  ``tan((c + 1) pi / 4)`` through 0.5), the hue turns by ``h`` in [-0.1, 0.1], and back to RGB. augmax
  0.4.1 computes a saturation change and drops the result, so saturation is unchanged: so here.

Learnt from openpi, not copied, and different where openpi's own choice is not one: openpi hands every
camera of a sample the same random key, so its two exterior cameras would take the same crop, angle and
jitter; here each camera draws its own. The steps of an observation history share their camera's draw.

Parameters come from the sample's own generator (:meth:`slurmvla.data.source.LeRobotSource.sample`), so a
sample is augmented the same at every world size, worker count and resume. The images stay uint8 (the
result rounded: at most half a level, 0.2 % of the range, from openpi's float).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from slurmvla.config.data import IMAGE_AUGMENTATIONS

CROP_FRACTION = 0.95
MAX_ANGLE_DEG = 5.0
BRIGHTNESS, CONTRAST, HUE = 0.3, 0.4, 0.1  # augmax ColorJitter's ranges (saturation: no effect, see above)
JITTER_PROBABILITY = 0.5

# One row of parameters per image: the crop centre's offset from the image centre (rows, columns; pixels),
# the angle (degrees), whether colours are jittered (0 / 1), brightness, contrast and hue amounts.
PARAMS = ("crop_dy", "crop_dx", "angle_deg", "jitter", "brightness", "contrast", "hue")
NUM_PARAMS = len(PARAMS)


def is_wrist(camera: str, wrist_cameras: list[str] | None) -> bool:
    """openpi's rule (a key that contains "wrist") unless the cameras are named."""
    return "wrist" in camera if wrist_cameras is None else camera in wrist_cameras


def crop_size(side: int) -> int:
    return int(side * CROP_FRACTION)


def draw_params(generator: torch.Generator, wrist: list[bool], height: int, width: int) -> torch.Tensor:
    """``[cameras, NUM_PARAMS]`` float32: one camera after another, seven uniforms each (a fixed count,
    so the draws after it never depend on the cameras' kinds); a wrist camera's geometry is zero."""
    u = torch.rand((len(wrist), NUM_PARAMS), generator=generator, dtype=torch.float64)
    limit_y, limit_x = (height - crop_size(height)) / 2, (width - crop_size(width)) / 2
    geometric = torch.tensor([0.0 if w else 1.0 for w in wrist], dtype=torch.float64)
    p = torch.stack([
        (2 * u[:, 0] - 1) * limit_y * geometric,
        (2 * u[:, 1] - 1) * limit_x * geometric,
        (2 * u[:, 2] - 1) * MAX_ANGLE_DEG * geometric,
        (u[:, 3] < JITTER_PROBABILITY).double(),
        (2 * u[:, 4] - 1) * BRIGHTNESS,
        (2 * u[:, 5] - 1) * CONTRAST,
        (2 * u[:, 6] - 1) * HUE,
    ], dim=1)
    return p.float()


def sampling_grid(crop_dy: float, crop_dx: float, angle_deg: float, height: int, width: int) -> torch.Tensor:
    """``grid_sample``'s grid ``[1, H, W, 2]`` (align_corners=True) for one image's crop, resize back and
    rotation: augmax's map, output pixel -> input pixel, with offsets ``(y, x)`` from the image centre:
    rotate by the angle (``[[cos, sin], [-sin, cos]]`` on ``(y, x)``), scale by crop / side, shift by the
    crop centre's offset. In grid_sample's coordinates ``-1`` and ``1`` are the first and last pixel centres
    (an offset of ``(side - 1) / 2`` pixels is 1). Built by broadcasting (affine_grid's batched matmul costs
    several times more on one thread)."""
    theta = math.radians(angle_deg)
    cos, sin = math.cos(theta), math.sin(theta)
    sy, sx = crop_size(height) / height, crop_size(width) / width
    hy, hx = (height - 1) / 2, (width - 1) / 2
    yn = torch.linspace(-1.0, 1.0, height).view(height, 1)
    xn = torch.linspace(-1.0, 1.0, width).view(1, width)
    grid = torch.empty(1, height, width, 2)
    grid[0, :, :, 0] = (sx * cos) * xn + (-sx * sin * hy / hx) * yn + crop_dx / hx
    grid[0, :, :, 1] = (sy * sin * hx / hy) * xn + (sy * cos) * yn + crop_dy / hy
    return grid


def color_jitter(rgb: torch.Tensor, brightness: float, contrast: float, hue: float) -> torch.Tensor:
    """``[3, H, W]`` floats in [0, 1] -> jittered as augmax's ColorJitter (see the module): RGB to HSV, the
    value's brightness and contrast, the hue's turn, back to RGB. Written for a worker's one thread: one
    image's amounts are Python numbers (each piecewise rule's branch is chosen once), channels are planes
    (a reduction or gather across channels, ``where`` and ``remainder`` cost several times an add)."""
    r, g, b = rgb.unbind(0)
    value = torch.maximum(torch.maximum(r, g), b)
    spread = value - torch.minimum(torch.minimum(r, g), b)
    # augmax's hue, times 6: 2 * argmax + (next channel - the one after) / spread, argmax the first maximum
    # (a grey pixel's hue does not matter: its chroma is 0).
    red = (r == value).float()
    green = (g == value).float() * (1 - red)
    blue = 1 - red - green
    hue6 = (red * (g - b) + green * (b - r + 2 * spread) + blue * (r - g + 4 * spread)) / spread.clamp_min(1e-30)
    saturation = spread / value.clamp_min(1e-30)  # 0 where the value is 0 (the spread is 0 there too)
    value = value * (1 + brightness) if brightness < 0 else value * (1 - brightness) + brightness
    slant = math.tan((contrast + 1) * (math.pi / 4))
    if slant != 1.0:
        # augmax's piecewise line: slope 1 / slant below p1 and above 1 - p1, slant between (continuous, so
        # the pieces' max / min picks the one that applies).
        low, mid = value / slant, slant * (value - 0.5) + 0.5
        high = low + (1 - 1 / slant)
        value = torch.minimum(torch.maximum(mid, low), high) if slant > 1 else torch.maximum(torch.minimum(mid, low), high)
    chroma = saturation * value
    turned = hue6 + 6 * hue
    out = torch.empty_like(rgb)
    for channel, n in enumerate((5.0, 3.0, 1.0)):
        k = turned + n  # in (-0.6, 11.6): mod 6 is at most one step of 6 either way
        k = k - 6 * ((k >= 6).float() - (k < 0).float())
        out[channel] = value - chroma * torch.clamp(torch.minimum(k, 4 - k), 0, 1)
    return out


def augment_float(x: torch.Tensor, params: torch.Tensor, geometric: torch.Tensor) -> torch.Tensor:
    """``[N, 3, H, W]`` floats in [0, 1] (changed in place and returned), image ``i`` by ``params[i]``:
    cropped and rotated where ``geometric[i]`` (a wrist camera is not, as in openpi), colour-jittered where
    its draw says so."""
    height, width = x.shape[-2:]
    for i, (dy, dx, angle, on, brightness, contrast, hue) in enumerate(params.tolist()):
        if geometric[i]:
            x[i] = F.grid_sample(x[i : i + 1], sampling_grid(dy, dx, angle, height, width), mode="bilinear",
                                 padding_mode="zeros", align_corners=True)[0]
        if on:
            x[i] = color_jitter(x[i], brightness, contrast, hue)
    return x


def augment(images: torch.Tensor, params: torch.Tensor, geometric: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, H, W, 3]`` -> uint8, through :func:`augment_float` (rounded to the nearest level)."""
    x = augment_float(images.permute(0, 3, 1, 2).float().div_(255.0), params, geometric)
    return x.clamp_(0.0, 1.0).mul_(255.0).round_().to(torch.uint8).permute(0, 2, 3, 1).contiguous()


class Augmenter:
    """``data.augment`` for one dataset's cameras: draws a sample's parameters and applies them."""

    def __init__(self, name: str, cameras: list[str], wrist_cameras: list[str] | None):
        if name not in IMAGE_AUGMENTATIONS or name == "none":
            raise ValueError(f"data.augment={name!r} names no augmentation; choose one of "
                             f"{[a for a in IMAGE_AUGMENTATIONS if a != 'none']}")
        self.name = name
        self.wrist = [is_wrist(c, wrist_cameras) for c in cameras]

    def __call__(self, images: torch.Tensor, image_mask: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """``images`` uint8 ``[history * cameras, H, W, 3]`` (cameras fastest) -> augmented; masked images
        (a padded camera, a step before the episode) are left as they are, but their draws are made."""
        cams = len(self.wrist)
        params = draw_params(generator, self.wrist, images.shape[1], images.shape[2]).repeat(len(images) // cams, 1)
        geometric = ~torch.tensor(self.wrist).repeat(len(images) // cams)
        live = image_mask.bool()
        if not bool(live.any()):
            return images
        out = images.clone()
        out[live] = augment(images[live], params[live], geometric[live])
        return out
