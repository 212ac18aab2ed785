"""openpi's wire encoding: msgpack with numpy arrays as maps ``{b"__ndarray__": True, b"data": raw bytes,
b"dtype": dtype.str, b"shape": shape}`` (and numpy scalars as ``{b"__npgeneric__": True, ...}``), as
``openpi_client.msgpack_numpy`` writes them. No pickle: arrays are rebuilt from raw bytes with numeric
dtypes only; what cannot be decoded is a :class:`BadRequest` (a ValueError) whose message goes back to the
client.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# dtype kinds a request may carry: bool, signed / unsigned integers, floats. Object, void and
# complex arrays are refused (an object array rebuilt from raw bytes would be raw pointers).
NUMERIC_KINDS = "biuf"


class BadRequest(ValueError):
    """A request the server cannot use; its message goes back to the client."""


def _pack_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in NUMERIC_KINDS:
            raise TypeError(f"cannot send an array of dtype {obj.dtype}")
        return {b"__ndarray__": True, b"data": np.ascontiguousarray(obj).tobytes(), b"dtype": obj.dtype.str,
                b"shape": obj.shape}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot send {type(obj).__name__}")


def _unpack_hook(obj: dict) -> Any:
    if b"__ndarray__" in obj:
        try:
            dtype = np.dtype(obj[b"dtype"])
            if dtype.kind not in NUMERIC_KINDS:
                raise ValueError(f"dtype {dtype} is not numeric")
            return np.ndarray(buffer=obj[b"data"], dtype=dtype, shape=tuple(obj[b"shape"]))
        except (KeyError, TypeError, ValueError) as e:
            raise BadRequest(f"an array in the request cannot be decoded ({e})") from None
    if b"__npgeneric__" in obj:
        try:
            dtype = np.dtype(obj[b"dtype"])
            if dtype.kind not in NUMERIC_KINDS:
                raise BadRequest(f"a scalar in the request has dtype {dtype}, which is not numeric")
            with np.errstate(over="ignore"):  # beyond the dtype's range is inf, refused where the value is read
                return dtype.type(obj[b"data"])
        except BadRequest:
            raise
        except (KeyError, TypeError, ValueError, OverflowError) as e:  # not "not a msgpack frame": it is one
            raise BadRequest(f"a scalar in the request cannot be decoded ({type(e).__name__}: {e})") from None
    return obj


def packb(obj: Any) -> bytes:
    import msgpack

    return msgpack.packb(obj, default=_pack_default)


def unpackb(data: bytes) -> Any:
    import msgpack

    try:
        return msgpack.unpackb(data, object_hook=_unpack_hook)
    except BadRequest:
        raise
    except Exception as e:  # msgpack's own errors: truncated, garbage or trailing bytes
        raise ValueError(f"the request is not a msgpack frame ({type(e).__name__}: {e})") from None
