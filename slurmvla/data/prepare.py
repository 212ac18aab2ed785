"""Input preparation shared by training and inference: one function per step, never a copy.

- :func:`resize_frame`: a video frame (any pixel format) -> RGB uint8 ``[size, size, 3]``, colour
  conversion and resize in one libswscale pass; ``pad`` keeps the aspect ratio and pads to a
  square with black (openpi's resize-with-pad), ``squash`` stretches. The decoder calls it on
  every decoded frame.
- :func:`prepare_image`: an RGB uint8 image from a client (e.g. openpi's DROID client) -> the same
  RGB uint8 ``[size, size, 3]``, through :func:`resize_frame`.
- :func:`text_fields`: the instruction -> the policy's tokens, with the policy's own tokenizer.
- :func:`observation_batch`: one observation -> a batch of one in the layout samples have (without
  the training-only fields: actions, pre-drawn noise, provenance); :func:`inference_fields` cuts a
  training batch down to the same keys.

State and action normalization is not here: the policy owns it (offset / scale buffers that travel
with its weights), so raw state goes in and raw actions come out in training and inference alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import av
import numpy as np
import torch

from slurmvla.config.data import IMAGE_RESIZE_MODES
from slurmvla.data.spec import SampleSpec

# What an observation gives a policy at inference time: no recorded actions, no pre-drawn training
# noise, no provenance. sample_actions sees only these, in the server, the evaluator and the checker.
INFERENCE_KEYS = ("images", "image_mask", "state", "instruction", "text", "text_mask")


def inference_fields(batch: dict) -> dict:
    """The part of a training batch that inference would have (:data:`INFERENCE_KEYS`)."""
    return {k: v for k, v in batch.items() if k in INFERENCE_KEYS}


def padded_size(height: int, width: int, size: int) -> tuple[int, int]:
    """``(h, w)`` of an image scaled to fit in ``size`` x ``size`` with its aspect ratio kept
    (the longer side becomes ``size``; the shorter is rounded down, as openpi's resize_with_pad does)."""
    ratio = max(width / size, height / size)
    return max(1, int(height / ratio)), max(1, int(width / ratio))


# One libswscale thread per conversion: frames are small and the callers already run in parallel
# (cameras on the reader's pool, the loader's workers). libswscale's automatic count starts a pool of one
# thread per core for each reader, and measured 2-4x slower per 180x320 frame on two busy cores.
SWS_THREADS = 1


def resize_frame(frame: av.VideoFrame, size: int | None, mode: str = "pad") -> np.ndarray:
    """RGB uint8 ``[size, size, 3]`` (bilinear), or the frame's own size when ``size`` is None.

    ``mode``: ``pad`` (scale to fit, centred on black; a square frame is just scaled) or ``squash``
    (stretch to the square). One of :data:`slurmvla.config.data.IMAGE_RESIZE_MODES`."""
    picture, top, left = fitted_picture(frame, size, mode)
    if size is None or picture.shape[:2] == (size, size):
        return picture
    out = np.zeros((size, size, 3), dtype=np.uint8)
    out[top : top + picture.shape[0], left : left + picture.shape[1]] = picture
    return out


def fitted_picture(frame: av.VideoFrame, size: int | None, mode: str = "pad") -> tuple[np.ndarray, int, int]:
    """:func:`resize_frame`'s picture without the black around it, and where it goes in the
    ``[size, size, 3]`` image: ``(picture, top, left)``."""
    if size is None:
        return frame.to_ndarray(format="rgb24", threads=SWS_THREADS), 0, 0
    if mode == "squash" or frame.width == frame.height:
        return frame.to_ndarray(format="rgb24", width=size, height=size, threads=SWS_THREADS), 0, 0
    if mode != "pad":
        raise ValueError(f"data.image_resize={mode!r} is not valid; choose one of {list(IMAGE_RESIZE_MODES)}")
    h, w = padded_size(frame.height, frame.width, size)
    picture = frame.to_ndarray(format="rgb24", width=w, height=h, threads=SWS_THREADS)
    return picture, (size - h) // 2, (size - w) // 2


def prepare_image(image: np.ndarray, size: int | None, name: str = "image", mode: str = "pad") -> np.ndarray:
    """An RGB image ``[H, W, 3]`` (uint8, or float in [0, 1] as openpi's client tools accept) -> the
    training layout ``[size, size, 3]`` uint8. A ValueError names ``name`` and what was expected."""
    try:
        image = np.asarray(image)
    except (ValueError, TypeError, OverflowError) as e:  # a ragged nested list, integers beyond int64
        raise ValueError(f"{name}: expected an RGB image [H, W, 3] (uint8), got a {type(image).__name__} numpy cannot "
                         f"read as an array ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if image.ndim != 3 or image.shape[-1] != 3:
        raise ValueError(f"{name}: expected an RGB image [H, W, 3] (uint8), got shape {list(image.shape)}")
    if image.shape[0] < 2 or image.shape[1] < 2:
        raise ValueError(f"{name}: image of {image.shape[0]}x{image.shape[1]} pixels is too small to resize")
    if np.issubdtype(image.dtype, np.floating):
        if not np.isfinite(image).all():
            raise ValueError(f"{name}: float image holds NaN or inf; send uint8 [H, W, 3]")
        image = (np.clip(image, 0.0, 1.0) * 255).astype(np.uint8)
    elif image.dtype != np.uint8:
        raise ValueError(f"{name}: expected dtype uint8 (or float in [0, 1]), got {image.dtype}")
    if size is None or image.shape[:2] == (size, size):  # None: the policy resizes it itself
        return np.ascontiguousarray(image)
    try:
        frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24")
        return resize_frame(frame, size, mode)
    except av.error.FFmpegError as e:  # libswscale's limits (a 2 x 3,000,000 image): its errno alone says nothing
        raise ValueError(f"{name}: an image of {image.shape[0]}x{image.shape[1]} pixels cannot be resized to "
                         f"{size}x{size} ({getattr(e, 'strerror', None) or e})") from None


def text_fields(spec: SampleSpec, instruction: str) -> dict[str, torch.Tensor]:
    """``text`` / ``text_mask`` from the policy's tokenizer; nothing when the policy has none."""
    if spec.tokenizer is None:
        return {}
    text, mask = spec.tokenizer(instruction)
    return {"text": text, "text_mask": mask}


def observation_batch(images: Sequence[np.ndarray], image_mask: Sequence[bool], state: np.ndarray,
                      instruction: str, spec: SampleSpec) -> dict:
    """A batch of one observation, as the policy's ``sample_actions`` reads it.

    ``images``: one prepared ``[size, size, 3]`` uint8 image per (history step, camera), oldest
    history step first, in ``data.cameras`` order within a step; ``image_mask``: False for a camera
    that is padded (absent); ``state``: raw ``[state_dim]`` (or ``[history, state_dim]``)."""
    batch = {
        "images": torch.from_numpy(np.stack(images))[None],
        "image_mask": torch.as_tensor(np.asarray(image_mask, dtype=bool))[None],
        "state": torch.as_tensor(np.asarray(state, dtype=np.float32))[None],
        "instruction": [instruction],
    }
    for key, value in text_fields(spec, instruction).items():
        batch[key] = value[None]
    return batch
