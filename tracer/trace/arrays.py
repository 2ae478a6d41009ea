"""Arrow columns as numpy arrays without pyarrow's pandas bridge.

``pa.Array.to_numpy`` converts through pyarrow's pandas conversion code, which imports pandas on its first call
(about 0.5 s, 1 s on a busy machine): more than ``validate`` spends on a small trace's rows. :func:`numpy_of`
reads the values buffer directly instead: zero-copy for fixed-width numbers, one unpacking pass for booleans.
A Python value given to a compute function (``pc.equal(stage, "prefill")``) goes through ``pa.scalar``, which
imports pandas too: :func:`string_scalar` builds a string scalar from its buffers.

Out of scope: arrays with nulls (the row checks reject them before converting), strings, nested types.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def _dtype(t: pa.DataType) -> np.dtype:
    if pa.types.is_integer(t):
        return np.dtype(f"{'i' if pa.types.is_signed_integer(t) else 'u'}{t.bit_width // 8}")
    if pa.types.is_floating(t):
        return np.dtype(f"f{t.bit_width // 8}")
    if pa.types.is_boolean(t):
        return np.dtype(bool)
    raise TypeError(f"numpy_of takes integer, floating-point and boolean arrays, not {t}")


def numpy_of(a: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """The values of the null-free Arrow array ``a`` (integer, floating-point or boolean; a chunked array's chunks
    concatenated) as a 1-d numpy array of the same type: a read-only view of its buffer where one chunk holds it.

    Raises ``ValueError`` if ``a`` holds nulls, ``TypeError`` for other types."""
    dtype = _dtype(a.type)
    if isinstance(a, pa.ChunkedArray):
        parts = [numpy_of(c) for c in a.chunks]
        return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, dtype)
    if a.null_count:
        raise ValueError(f"numpy_of takes arrays without nulls; this one has {a.null_count}")
    n, off = len(a), a.offset
    buf = a.buffers()[1]
    if n == 0 or buf is None:
        return np.zeros(0, dtype)
    if dtype == np.dtype(bool):  # bit-packed, least significant bit first
        first, last = off // 8, -(-(off + n) // 8)
        bits = np.unpackbits(np.frombuffer(buf, np.uint8, count=last - first, offset=first), bitorder="little")
        return bits[off % 8 : off % 8 + n].view(bool)
    return np.frombuffer(buf, dtype, count=n, offset=off * dtype.itemsize)


def string_scalar(value: str) -> pa.StringScalar:
    """``pa.scalar(value, pa.string())``, built from buffers (``pa.scalar`` imports pandas)."""
    data = value.encode()
    offsets = np.array([0, len(data)], np.int32)
    return pa.StringArray.from_buffers(1, pa.py_buffer(offsets.tobytes()), pa.py_buffer(data))[0]
