"""A strict safetensors reader and writer, numpy only (no torch at run time).

The reader trusts nothing in the file: the header length, the JSON, every
dtype, shape and offset are checked against the file's real size before any
tensor is touched, so a truncated or hostile file fails with a message that
names the file and the tensor, never with a crash or a huge allocation.
bfloat16 (which numpy lacks) is read and written as float32 (``srm_max.bfloat16``).
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import numpy as np

from ..bfloat16 import from_bfloat16_bits, to_bfloat16_bits
from ..errors import CheckpointError
from ..files import check_regular_file
from ..scalars import is_plain_int

# safetensors dtype name -> numpy dtype of the stored bytes (bfloat16 as raw uint16)
_STORED = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
FLOAT_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_MAX_HEADER = 100 * 1024 * 1024  # the format's own limit


def _refuse_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object, refusing a repeated key (``json`` would keep the last one silently, so
    two readers could disagree on which tensor a name means)."""
    result = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


class SafetensorsFile:
    """The validated header of a safetensors file; tensors are read on demand."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        check_regular_file(self.path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                prefix = f.read(8)
                if len(prefix) < 8:
                    raise CheckpointError(f"{self.path}: truncated (only {size} bytes, no safetensors header)")
                (header_len,) = struct.unpack("<Q", prefix)
                if header_len > min(_MAX_HEADER, size - 8):
                    raise CheckpointError(
                        f"{self.path}: corrupt or truncated header (says {header_len} bytes, file has {size})"
                    )
                raw = f.read(header_len)
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: file not found") from None
        except OSError as e:  # no permission to read it, an I/O error
            raise CheckpointError(f"{self.path}: cannot read ({e.strerror or e})") from None
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=_refuse_duplicate_keys)
        except (ValueError, RecursionError) as e:  # ValueError covers JSONDecodeError and Unicode
            raise CheckpointError(f"{self.path}: corrupt safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: corrupt safetensors header (not a JSON object)")
        self.metadata = header.pop("__metadata__", None) or {}
        if not isinstance(self.metadata, dict) or not all(isinstance(v, str) for v in self.metadata.values()):
            raise CheckpointError(f"{self.path}: corrupt safetensors header (__metadata__ is not a map of strings)")
        self.data_start = 8 + header_len
        data_size = size - self.data_start
        self.entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            self.entries[name] = self._check_entry(name, info, data_size)
        self._check_tiling(data_size)

    def _check_tiling(self, data_size: int) -> None:
        """The tensors must cover the data buffer exactly, in some order: an overlap would let
        two tensors share bytes, and a gap or a tail is data no tensor accounts for (the
        safetensors format refuses both)."""
        expected_begin, previous = 0, None
        for name, (_, _, begin, end) in sorted(self.entries.items(), key=lambda item: item[1][2:]):
            if begin != expected_begin:
                problem = f"overlaps tensor {previous!r}" if begin < expected_begin else "leaves a gap before it"
                raise CheckpointError(f"{self.path}: tensor {name!r}: data_offsets [{begin}, {end}] {problem} "
                                      "(the tensors must tile the data exactly)")
            expected_begin, previous = end, name
        if expected_begin != data_size:
            raise CheckpointError(f"{self.path}: the tensors cover {expected_begin} bytes of data but the file holds "
                                  f"{data_size} (unaccounted bytes after the last tensor)")

    def _check_entry(self, name, info, data_size):
        where = f"{self.path}: tensor {name!r}"
        if not isinstance(info, dict):
            raise CheckpointError(f"{where}: header entry is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in _STORED:  # a list or object is not hashable
            raise CheckpointError(f"{where}: unsupported dtype {dtype!r}")
        if not isinstance(shape, list) or not all(is_plain_int(s) and s >= 0 for s in shape):
            raise CheckpointError(f"{where}: invalid shape {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(is_plain_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise CheckpointError(f"{where}: invalid data_offsets {offsets!r}")
        begin, end = offsets
        if end > data_size:
            raise CheckpointError(
                f"{where}: data ends at byte {end} but the file holds {data_size} bytes of data (truncated?)"
            )
        expected = math.prod(shape) * _STORED[dtype].itemsize
        if end - begin != expected:
            raise CheckpointError(
                f"{where}: {end - begin} bytes stored for shape {shape} of {dtype} ({expected} needed)"
            )
        return dtype, tuple(shape), begin, end

    def dtype(self, name: str) -> str:
        return self.entries[name][0]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1]

    def nbytes(self, name: str) -> int:
        _, _, begin, end = self.entries[name]
        return end - begin

    def read(self, name: str) -> np.ndarray:
        """The tensor as stored (bfloat16 as raw uint16 bits), a fresh copy."""
        dtype, shape, begin, end = self.entries[name]
        data = np.empty(shape, _STORED[dtype])
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin)
            if f.readinto(memoryview(data).cast("B")) != end - begin:
                raise CheckpointError(f"{self.path}: tensor {name!r}: file ended early (truncated?)")
        return data

    def read_float32(self, name: str) -> np.ndarray:
        if self.dtype(name) not in ("F32", "F16", "BF16", "F64"):
            raise CheckpointError(f"{self.path}: tensor {name!r} has dtype {self.dtype(name)}, expected a float type")
        data = self.read(name)
        if self.dtype(name) == "BF16":
            return from_bfloat16_bits(data)
        return data.astype(np.float32, copy=False)


def write_safetensors(
    path: str | Path, tensors: dict[str, np.ndarray], dtype: str = "float32", metadata: dict | None = None
) -> None:
    """Write float tensors in ``dtype`` (float32, bfloat16 or float16); fsynced, not atomic
    by itself: callers write into a temporary directory and rename it."""
    code = FLOAT_DTYPES[dtype]
    header: dict = {"__metadata__": {k: str(v) for k, v in (metadata or {}).items()}}
    blobs, offset = [], 0
    for name in sorted(tensors):
        array = np.asarray(tensors[name], dtype=np.float32)
        if code == "BF16":
            data = to_bfloat16_bits(array)
        else:
            data = array.astype(_STORED[code])
        raw = np.ascontiguousarray(data).tobytes()
        header[name] = {"dtype": code, "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # align the data to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for raw in blobs:
            f.write(raw)
        f.flush()
        os.fsync(f.fileno())
