"""Cameras stored as images (LeRobot's ``"dtype": "image"``, e.g. lerobot/metaworld_mt50): each frame is an encoded
image (PNG, as ``datasets``' ``Image()`` writes it; JPEG, WebP, TIFF or BMP too) in a column of the data parquet, not
a frame of a video.

:class:`ImageReader` is :class:`slurmvla.data.video.FrameReader`'s counterpart for such a camera: the same
``read`` / ``placement`` / ``close``, so the episode readers (:meth:`~slurmvla.data.source.LeRobotSource.load_episode`,
the stream's and validation's windows) hold either. Frames are decoded with FFmpeg's image decoders (PyAV, already
the video decoder: no new dependency) and converted and resized by the same libswscale pass as a video's frames
(:func:`slurmvla.data.prepare.resize_frame`), so everything downstream (``policy.image_size``, augmentation, history
frames) sees the same uint8 ``[H, W, 3]``. A PNG's pixels are exact; a JPEG's chroma is upsampled by libswscale, which
may differ from libjpeg's (PIL's) by a few levels.

A frame without bytes or whose bytes are not a readable image is a :class:`~slurmvla.data.DataError` naming the data
file, the episode, the frame and the camera: ``data.on_damaged`` handles it as it does a video that does not decode.
"""

from __future__ import annotations

import av
import numpy as np

from slurmvla.data import DataError
from slurmvla.data.lerobot_format import LeRobotMetadata
from slurmvla.data.prepare import fitted_picture, resize_frame

# An encoded image's first bytes -> FFmpeg's decoder for it.
SIGNATURES = ((b"\x89PNG\r\n\x1a\n", "png"), (b"\xff\xd8\xff", "mjpeg"), (b"II*\x00", "tiff"), (b"MM\x00*", "tiff"),
              (b"BM", "bmp"))
FORMATS = "PNG, JPEG, WebP, TIFF or BMP"


def _decoder(data: bytes) -> str | None:
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return next((codec for magic, codec in SIGNATURES if data.startswith(magic)), None)


def decode_image(data: bytes | None) -> av.VideoFrame:
    """One encoded image as a frame (its own pixel format); a ``ValueError`` saying why it is not one."""
    if data is None or len(data) == 0:
        raise ValueError("it has no image bytes" if data is None else "its image bytes are empty")
    codec = _decoder(data)
    if codec is None:
        raise ValueError(f"its {len(data)} bytes are not a {FORMATS} image (they begin {bytes(data[:8])!r})")
    context = av.CodecContext.create(codec, "r")
    context.thread_count = 1  # frames are small; the cameras and the loader's workers already run in parallel
    try:
        frames = context.decode(av.Packet(data)) or context.decode(None)
    except (av.error.FFmpegError, ValueError) as e:
        raise ValueError(f"its {codec.replace('mjpeg', 'jpeg').upper()} image cannot be decoded "
                         f"({getattr(e, 'strerror', None) or e})") from None
    if not frames:
        raise ValueError(f"its {codec.replace('mjpeg', 'jpeg').upper()} image decodes to nothing (truncated?)")
    return frames[0]


class ImageReader:
    """Frames ``[first, first + num_frames)`` of the image camera ``key`` of the episode at position ``pos``, forward,
    as uint8 RGB ``[size, size, 3]`` (the images' own size when ``size`` is None). The encoded bytes are read from the
    data file ``chunk`` frames at a time (all at once when None): a window over a long episode holds one chunk of
    them, not the episode's."""

    CHUNK = 32  # frames whose encoded bytes a window holds at a time (~5 MB at 480 x 480)

    def __init__(self, meta: LeRobotMetadata, pos: int, key: str, first: int, num_frames: int, size: int | None,
                 resize: str = "pad", chunk: int | None = None):
        if num_frames <= 0:
            raise ValueError(f"empty frame range [{first}, {first + num_frames}) of camera {key!r}")
        self.meta, self.pos, self.key, self.first, self.num_frames = meta, pos, key, first, num_frames
        self.size, self.resize, self.chunk = size, resize, chunk or num_frames
        self.path = meta.episode_data_path(pos)
        self.next = 0  # index (in the range) of the next frame read() returns
        self.placement = (0, 0)  # (top, left) of the pictures read(picture_only=True) returns, in a full image
        self._encoded: list[bytes | None] = []
        self._encoded_from = 0  # range index of self._encoded[0]

    def _bytes(self, k: int) -> bytes | None:
        if not self._encoded_from <= k < self._encoded_from + len(self._encoded):
            end = min(self.num_frames, k + self.chunk)
            column = self.meta.read_frames(self.pos, [self.key], self.first + k, self.first + end)[self.key]
            self._encoded, self._encoded_from = list(column), k
        data = self._encoded[k - self._encoded_from]
        self._encoded[k - self._encoded_from] = None  # read forward: never needed again
        return data

    def read(self, n: int, out: np.ndarray | None = None, picture_only: bool = False) -> np.ndarray:
        """The next ``n`` frames (fewer at the range's end) into ``out`` (may be a strided view); with
        ``picture_only``, each frame's picture without the padding around it (``placement`` says where it goes)."""
        n = min(n, self.num_frames - self.next)
        for i in range(n):
            k = self.next + i
            data = self._bytes(k)  # a data file that cannot be read is a DataError naming it already
            try:
                frame = decode_image(data)
            except ValueError as e:
                episode = int(self.meta.episodes["episode_index"][self.pos])
                raise DataError(f"{self.path}: frame {self.first + k} of episode {episode}, camera {self.key!r}: {e}; "
                                "the file is damaged", self.path) from None
            if picture_only:
                img, top, left = fitted_picture(frame, self.size, self.resize)
                self.placement = (top, left)
            else:
                img = resize_frame(frame, self.size, self.resize)
            if out is None:
                out = np.empty((n, *img.shape), dtype=np.uint8)
            elif out.shape[1:] != img.shape:
                # Only without a target size (the policy resizes itself): a frame unlike its camera's others.
                episode = int(self.meta.episodes["episode_index"][self.pos])
                raise DataError(f"{self.path}: frame {self.first + k} of episode {episode}, camera {self.key!r}, is "
                                f"{img.shape[0]}x{img.shape[1]}, where the camera's frames are {out.shape[1]}x"
                                f"{out.shape[2]} (meta/info.json's shape, or its other frames)", self.path)
            out[i] = img
        self.next += n
        if out is None:
            out = np.empty((0, 0, 0, 3), dtype=np.uint8)
        return out

    def close(self) -> None:
        self._encoded = []


def decode_images(meta: LeRobotMetadata, pos: int, key: str, first: int, num_frames: int, size: int | None,
                  out: np.ndarray | None = None, resize: str = "pad") -> np.ndarray:
    """Frames ``[first, first + num_frames)`` of an image camera at once (:func:`slurmvla.data.video.decode_range`'s
    counterpart): uint8 ``[T, H, W, 3]``, into ``out`` when given."""
    return ImageReader(meta, pos, key, first, num_frames, size, resize).read(num_frames, out)
