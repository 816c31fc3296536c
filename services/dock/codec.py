"""One row's value <-> raw bytes: a small header (dtype, shape) and the array's bytes. No pickle.

Layout (little-endian): byte 0 dtype code, byte 1 ndim, then ndim uint32 dimensions, then the
C-contiguous data. The header is fixed-size per ndim so the dock's Lua can append along axis 0
(partial responses) by rewriting dimension 0 and concatenating the data.
"""
from __future__ import annotations

import contextlib
import struct
from collections.abc import Sequence

import numpy as np

from services.common.errors import InvalidArgument

# dtype name -> wire code; "utf8" is a Python str stored as its UTF-8 bytes (labels, answers).
DTYPE_CODES: dict[str, int] = {
    "bool": 1, "uint8": 2, "int32": 3, "int64": 4, "float16": 5, "float32": 6, "float64": 7, "utf8": 8,
}
_CODE_DTYPES = {code: name for name, code in DTYPE_CODES.items()}
# Looked up by dtype object: dtype.name is slow enough to matter at tens of thousands of values per put.
_DTYPE_TO_CODE = {np.dtype(name): code for name, code in DTYPE_CODES.items() if name != "utf8"}
_NUMPY_DTYPES = {code: np.dtype(name) for name, code in DTYPE_CODES.items() if name != "utf8"}
_DTYPES_BY_NAME = {name: np.dtype(name) for name in DTYPE_CODES if name != "utf8"}
# Header per ndim (dtype code, ndim, dims): one precompiled pack per value instead of one per dimension.
_HEADERS = [struct.Struct(f"<BB{ndim}I") for ndim in range(65)]  # numpy allows up to 64 dimensions
# Scalar columns a Python int (int columns) or float (float columns) packs into directly, as numpy would
# convert it: the format and the accepted type. An int into a float column takes the checked path.
_SCALARS = {"int32": (struct.Struct("<BBi"), (int,)), "int64": (struct.Struct("<BBq"), (int,)),
            "float32": (struct.Struct("<BBf"), (float,)), "float64": (struct.Struct("<BBd"), (float,))}
# Python values of these numpy kinds convert to a column of the key's kind without losing anything.
_ACCEPTED_KINDS = {"b": "b", "u": "bu", "i": "biu", "f": "biuf"}

Value = np.ndarray | Sequence[int] | Sequence[float] | str | int | float


def _header(code: int, shape: tuple[int, ...]) -> bytes:
    return _HEADERS[len(shape)].pack(code, len(shape), *shape)


def to_array(value: Value, dtype: str, field: str) -> np.ndarray | str:
    """`value` as the column's dtype: numpy arrays must already have it; Python lists and scalars are converted."""
    if dtype == "utf8":
        if not isinstance(value, str):
            raise InvalidArgument(field, f"expected a str for a utf8 column, got {type(value).__name__}")
        return value
    if isinstance(value, str):
        raise InvalidArgument(field, f"expected numbers of dtype {dtype}, got a str")
    if isinstance(value, np.ndarray):
        if value.dtype != _DTYPES_BY_NAME[dtype]:
            raise InvalidArgument(field, f"dtype {value.dtype} does not match the column's dtype {dtype}")
        return value
    inferred = np.asarray(value)
    if inferred.size and inferred.dtype.kind not in _ACCEPTED_KINDS[np.dtype(dtype).kind]:
        raise InvalidArgument(field, f"values of kind {inferred.dtype} cannot be stored in a {dtype} column")
    try:
        array = np.asarray(value, dtype=dtype)
    except (OverflowError, ValueError, TypeError) as exc:
        raise InvalidArgument(field, f"cannot be stored as {dtype}: {exc}") from None
    return array


def encode(value: np.ndarray | str) -> bytes:
    """Header + raw bytes of an array (or a str, as utf8) already checked by `to_array`."""
    if isinstance(value, str):
        data = value.encode()
        return _header(DTYPE_CODES["utf8"], (len(data),)) + data
    array = value if value.flags.c_contiguous else value.copy(order="C")  # ascontiguousarray would make 0-d 1-d
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    code = _DTYPE_TO_CODE.get(array.dtype)
    if code is None:
        raise InvalidArgument("dtype", f"{value.dtype} is not storable (use one of {', '.join(DTYPE_CODES)})")
    return _header(code, array.shape) + array.tobytes()


def encode_column(values, dtype: str, shape: tuple[int | None, ...], check) -> list[bytes]:
    """Encodes one column's values (a put's); `check(i, value)` is the checked path for values[i].

    The common values (an ndarray of the column's dtype and rank with free dimensions, a str for a
    utf8 column, a Python int or float for a scalar column) are encoded here directly; `check`
    takes the rest (conversions, and the values it refuses with the field named). About 4 us a
    value went to the general path's conversions and checks: at 2,304 values an iteration that
    was as much client time as Redis spent on the dock.
    """
    want = _DTYPES_BY_NAME.get(dtype)
    free = all(d is None for d in shape)  # any extent fits: only the rank needs checking
    ndim = len(shape)
    scalar = _SCALARS.get(dtype) if ndim == 0 else None
    blobs = []
    for i, value in enumerate(values):
        kind = type(value)
        blob = None
        if kind is np.ndarray:
            if free and value.dtype == want and value.ndim == ndim and value.flags.c_contiguous:
                blob = _HEADERS[ndim].pack(_DTYPE_TO_CODE[want], ndim, *value.shape) + value.tobytes()
        elif kind is str:
            if dtype == "utf8":
                blob = encode(value)
        elif scalar is not None and kind in scalar[1]:
            with contextlib.suppress(struct.error, OverflowError):  # out of the dtype's range: the checked path says so
                blob = scalar[0].pack(DTYPE_CODES[dtype], 0, value)
        blobs.append(blob if blob is not None else check(i, value))
    return blobs


def decode(blob: bytes) -> np.ndarray | str:
    """The array (or str) that `encode` wrote; the array is a read-only view over `blob`."""
    if len(blob) < 2 or blob[0] not in _CODE_DTYPES:
        raise ValueError(f"not a dock value: {len(blob)} bytes starting {blob[:4]!r}")
    code, ndim = blob[0], blob[1]
    offset = 2 + 4 * ndim
    if code == DTYPE_CODES["utf8"]:
        return bytes(blob[offset:]).decode()
    array = np.frombuffer(blob, dtype=_NUMPY_DTYPES[code], offset=offset)
    # 1-D (per-token columns, most values) is frombuffer's own shape; others take the stored one.
    return array if ndim == 1 else array.reshape(_HEADERS[ndim].unpack_from(blob)[2:])
