"""The safetensors file format (Hugging Face's), read and written here in a few lines.

A file is an 8-byte little-endian header length, a JSON header (per tensor: ``dtype``, ``shape``,
``data_offsets`` relative to the end of the header; an optional ``__metadata__`` map of strings), then
the raw little-endian data. Written here rather than with the `safetensors` package: the format is
small, the package is not a dependency of cortexc (nor installed in its environment), and the C side of
`cortexc export` reads and writes the same bytes without it. Malformed files raise `InputError` naming
the file and what is wrong.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from cortexc.errors import InputError

#: the dtypes cortexc reads and writes, by their safetensors name
DTYPES: Mapping[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}

#: a header larger than this is refused (the reference implementation's limit)
MAX_HEADER = 100_000_000


def is_safetensors(path: str | os.PathLike[str]) -> bool:
    return str(path).endswith(".safetensors")


def save(path: str | os.PathLike[str], tensors: Mapping[str, np.ndarray]) -> None:
    """Write the tensors (in the given order) to `path`, whole or not at all."""
    header: dict[str, object] = {}
    blobs = []
    offset = 0
    for name, value in tensors.items():
        array = np.asarray(value)
        dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
        if dtype not in _NAMES:
            raise InputError(f"tensor {name}: safetensors files hold {', '.join(DTYPES)} here, not {array.dtype}")
        blob = np.ascontiguousarray(array, dtype=dtype).tobytes()
        header[name] = {
            "dtype": _NAMES[dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the reference writer does
    target = Path(path)
    handle, scratch = tempfile.mkstemp(prefix=f".{target.name}-", dir=target.parent or ".")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(len(text).to_bytes(8, "little"))
            out.write(text)
            for blob in blobs:
                out.write(blob)
        os.replace(scratch, target)
    except BaseException:
        Path(scratch).unlink(missing_ok=True)
        raise


def load(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Every tensor of the file by name (copies; the file is closed on return)."""
    data = Path(path).read_bytes()
    where = str(path)
    if len(data) < 8:
        raise InputError(f"{where}: not a safetensors file (shorter than its 8-byte header length)")
    size = int.from_bytes(data[:8], "little")
    if size > MAX_HEADER or 8 + size > len(data):
        raise InputError(f"{where}: truncated or not a safetensors file (header of {size} bytes)")
    try:
        header = json.loads(data[8 : 8 + size].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"{where}: the safetensors header is not valid JSON ({err})") from None
    if not isinstance(header, dict):
        raise InputError(f"{where}: the safetensors header is not a JSON object")
    body = memoryview(data)[8 + size :]
    tensors: dict[str, np.ndarray] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            start, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise InputError(f"{where}: tensor {name}: unsupported dtype or malformed entry {entry!r}") from None
        count = int(np.prod(shape, dtype=np.int64))
        if min(shape, default=0) < 0 or start < 0 or end > len(body) or end - start != count * dtype.itemsize:
            raise InputError(f"{where}: tensor {name}: data_offsets {[start, end]} do not fit its shape or the file")
        tensors[name] = np.frombuffer(body[start:end], dtype=dtype).reshape(shape).copy()
    return tensors
