"""Video decoding with PyAV (FFmpeg and dav1d bundled in the wheel; no system FFmpeg needed).

- :class:`FrameReader`: one camera's frames of one time range, decoded forward a block at a time
  (one seek to the keyframe before the range, then never again). The stream's windowed episodes
  hold a reader per camera and keep only the frames a sample still needs.
- :func:`decode_range`: a whole range at once, through a reader.
- :func:`read_concurrently`: the next block of several readers (an episode's cameras) at once;
  PyAV releases the GIL while it decodes and converts, so the cameras decode in parallel.

Frames are converted and resized in one libswscale pass (:func:`slurmvla.data.prepare.resize_frame`,
which inference shares).
"""

from __future__ import annotations

import os
import weakref
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import av
import numpy as np

from slurmvla import garbage_collector
from slurmvla.data import DataError
from slurmvla.data.checksums import verify
from slurmvla.data.prepare import fitted_picture, resize_frame

DECODER_THREADS = 1


class FrameReader:
    """Frames ``[from_ts, from_ts + num_frames / fps)`` of one video, forward, as uint8 RGB
    ``[size, size, 3]`` (the video's own size when ``size`` is None)."""

    def __init__(self, path: str | Path, from_ts: float, num_frames: int, fps: float, size: int | None,
                 resize: str = "pad"):
        if num_frames <= 0:
            raise ValueError(f"empty video range [{from_ts}, {from_ts + num_frames / fps}) in {path}")
        self.path, self.from_ts, self.num_frames, self.fps = path, from_ts, num_frames, fps
        self.size, self.resize = size, resize
        self.next = 0  # index (in the range) of the next frame read() returns
        self._container = None
        try:
            verify(path)  # a byte changed in a packet may decode silently to other pixels: checksums tell
            self._container = av.open(str(path))
        except FileNotFoundError:
            raise DataError(f"video {path} does not exist, but the dataset's metadata names it (an incomplete "
                            "copy?)", path) from None
        except (OSError, av.error.FFmpegError) as e:
            raise DataError(f"video {path} cannot be opened ({_reason(e)}); the file is damaged or not a video",
                            path) from None
        if not self._container.streams.video:
            self.close()
            raise DataError(f"video {path} has no video stream", path)
        stream = self._container.streams.video[0]
        if stream.codec_context is None:  # a damaged header: the stream's codec cannot be opened
            self.close()
            raise DataError(f"video {path}: its video stream's codec cannot be opened; the file is damaged", path)
        # One decoding thread per decoder: the cameras decode in parallel on read_concurrently's pool
        # and the loader's workers run side by side. FFmpeg's automatic count is one thread per core for
        # every open decoder, and a stream worker holds one per camera of each interleaved episode (24
        # by default): thousands of threads per worker on a many-core node, each with its own buffers.
        stream.codec_context.thread_count = DECODER_THREADS
        if from_ts > 0:
            try:
                self._container.seek(int(from_ts / stream.time_base), stream=stream, backward=True, any_frame=False)
            except av.error.FFmpegError as e:
                self.close()
                raise DataError(f"{path}: the video cannot be read to {from_ts:.3f} s ({_reason(e)})", path) from None
        self._time_base = float(stream.time_base)
        self._frames = self._container.decode(stream)
        self._ahead: tuple[int, av.VideoFrame] | None = None  # a frame decoded past the last block
        self.placement = (0, 0)  # (top, left) of the pictures read(picture_only=True) returns, in a full image
        _OPEN.add(self)

    def read(self, n: int, out: np.ndarray | None = None, picture_only: bool = False) -> np.ndarray:
        """The next ``n`` frames (fewer at the range's end) into ``out`` (may be a strided view). With
        ``picture_only``, each frame's picture without the padding around it (``placement`` says where
        it goes): a window's buffered frames hold no black."""
        n = min(n, self.num_frames - self.next)
        start, end = self.next, self.next + n
        filled = np.zeros(n, dtype=bool)
        while n > 0:
            if self._ahead is not None:
                (k, frame), self._ahead = self._ahead, None
            else:
                try:
                    frame = next(self._frames, None)
                except av.error.FFmpegError as e:  # a damaged stream past the header
                    self.close()
                    raise DataError(f"{self.path}: the video cannot be decoded ({_reason(e)})", self.path) from None
                if frame is None:
                    break
                if frame.pts is None:
                    continue
                k = int(round((frame.pts * self._time_base - self.from_ts) * self.fps))
            if k < start:
                continue
            if k >= end:
                self._ahead = (k, frame)
                break
            if picture_only:
                img, top, left = fitted_picture(frame, self.size, self.resize)
                self.placement = (top, left)
            else:
                img = resize_frame(frame, self.size, self.resize)
            if out is None:
                out = np.empty((n, *img.shape), dtype=np.uint8)
            out[k - start] = img
            filled[k - start] = True
            if k == end - 1:
                break
        if out is None or not filled.all():
            missing = int((~filled).sum())
            t0, t1 = self.from_ts + start / self.fps, self.from_ts + end / self.fps
            self.close()
            raise DataError(f"{self.path}: {missing} of {n} frames in [{t0:.3f}, {t1:.3f}) s could not be decoded",
                            self.path)
        self.next = end
        return out

    def close(self) -> None:
        if self._container is not None:
            self._container.close()

    def _orphan(self) -> None:
        """In a forked child: this reader's decoder was opened by the parent and its threads did not
        survive the fork, so closing or freeing it would wait for them forever. Keep its native
        objects alive, untouched, for the child's lifetime, and make the reader closed."""
        _ORPHANS.append((self._container, self._frames, self._ahead))
        self._container, self._frames, self._ahead = None, iter(()), None
        self.next = self.num_frames


# Readers open in this process. A data-loader worker is forked while the parent may hold open
# readers (validation in the main process, a stream iterated in-process, garbage not yet collected):
# their decoders' threads exist only in the parent. Before a fork, garbage is collected (in the
# parent, where freeing a decoder works) and what lives is frozen (_before_fork); in the child, every
# inherited reader is orphaned.
_OPEN: weakref.WeakSet[FrameReader] = weakref.WeakSet()
_ORPHANS: list = []


def _reason(e: BaseException) -> str:
    """PyAV's error without the file name it repeats (the message names the file once)."""
    return getattr(e, "strerror", None) or str(e)


def _orphan_inherited_readers() -> None:
    for reader in list(_OPEN):
        reader._orphan()
    _OPEN.clear()


def _before_fork() -> None:
    """Garbage collected, then every object still alive frozen (:func:`slurmvla.garbage_collector.freeze`: later
    collections, in this process and in the child, never visit it). A collection writes into each object it
    visits; after a fork that write copies the page in whichever process makes it, and the child's copy of
    every page the parent's next full collection visits becomes the child's alone (docs/data.md measures it).
    Cycles among objects alive at a fork (a loader's start, once per run) wait for the run's end
    (:func:`slurmvla.garbage_collector.thaw`)."""
    garbage_collector.freeze()


os.register_at_fork(before=_before_fork, after_in_child=_orphan_inherited_readers)


def decode_range(path: str | Path, from_ts: float, to_ts: float, fps: float, size: int | None,
                 out: np.ndarray | None = None, resize: str = "pad") -> np.ndarray:
    """Decode the frames with timestamps in ``[from_ts, to_ts)`` as uint8 ``[T, H, W, 3]``: one seek,
    then forward decoding. ``out`` (``[T, size, size, 3]`` uint8, may be a strided view) receives
    the frames without a second copy."""
    reader = FrameReader(path, from_ts, int(round((to_ts - from_ts) * fps)), fps, size, resize)
    try:
        return reader.read(reader.num_frames, out)
    finally:
        reader.close()


_POOL: tuple[int, ThreadPoolExecutor] | None = None


def _pool() -> ThreadPoolExecutor:
    """This process's decode threads (a forked dataloader worker makes its own)."""
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid():
        _POOL = (os.getpid(), ThreadPoolExecutor(max_workers=4, thread_name_prefix="slurmvla-decode"))
    return _POOL[1]


def read_concurrently(readers: list[FrameReader], n: int, picture_only: bool = False) -> list[np.ndarray]:
    """``reader.read(n, picture_only=picture_only)`` of every reader, the readers in parallel threads."""
    if len(readers) == 1:
        return [readers[0].read(n, picture_only=picture_only)]
    futures = [_pool().submit(r.read, n, None, picture_only) for r in readers]
    wait(futures)  # all finish before an error propagates: a reader is never closed mid-decode
    return [future.result() for future in futures]
