"""Video decoding with PyAV (FFmpeg bundled in the wheel; no system FFmpeg needed)."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np

from slurmvla.data.prepare import resize_frame


def decode_range(path: str | Path, from_ts: float, to_ts: float, fps: float, size: int | None,
                 out: np.ndarray | None = None) -> np.ndarray:
    """Decode the frames with timestamps in ``[from_ts, to_ts)`` as uint8 ``[T, H, W, 3]``.

    One seek to the keyframe before ``from_ts``, then forward decoding: an episode costs one pass,
    never a seek per frame. Frames are resized to ``size`` x ``size`` during colour conversion
    (:func:`slurmvla.data.prepare.resize_frame`, which inference shares).
    ``out`` (``[T, size, size, 3]`` uint8, may be a strided view) receives the frames without a
    second copy.
    """
    num_frames = int(round((to_ts - from_ts) * fps))
    if num_frames <= 0:
        raise ValueError(f"empty video range [{from_ts}, {to_ts}) in {path}")
    filled = np.zeros(num_frames, dtype=bool)
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        if from_ts > 0:
            container.seek(int(from_ts / stream.time_base), stream=stream, backward=True, any_frame=False)
        time_base = float(stream.time_base)
        for frame in container.decode(stream):
            if frame.pts is None:
                continue
            k = int(round((frame.pts * time_base - from_ts) * fps))
            if k < 0:
                continue
            if k >= num_frames:
                break
            img = resize_frame(frame, size)
            if out is None:
                out = np.empty((num_frames, *img.shape), dtype=np.uint8)
            out[k] = img
            filled[k] = True
    if out is None or not filled.all():
        missing = int((~filled).sum())
        raise ValueError(f"{path}: {missing} of {num_frames} frames in [{from_ts:.3f}, {to_ts:.3f}) s could not be decoded")
    return out
