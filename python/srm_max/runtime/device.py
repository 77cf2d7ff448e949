"""Devices and weight dtypes: what a user names (``"cpu"``, ``"bfloat16"``) to what MAX takes."""

from __future__ import annotations

import numpy as np
from max.driver import CPU, Accelerator, Device, accelerator_count
from max.dtype import DType
from max.graph import DeviceRef

from ..errors import GenerationError

# the weight dtypes the engines run, the default first
DTYPES = {"float32": DType.float32, "bfloat16": DType.bfloat16}
DEVICES = ("auto", "cpu", "gpu")
DEFAULT_DEVICE = "auto"  # a GPU when there is one, else the CPU


def check_device_name(device) -> str:
    """``device`` lower-cased if it is one of ``DEVICES`` (whether this machine has it or not)."""
    if not isinstance(device, str) or device.lower() not in DEVICES:
        raise GenerationError(f"unknown device {device!r}: expected one of {', '.join(DEVICES)}")
    return device.lower()


def resolve_device(device: str) -> tuple[Device, DeviceRef]:
    device = check_device_name(device)
    if device == "auto":
        device = "gpu" if accelerator_count() > 0 else "cpu"
    if device == "gpu":
        if accelerator_count() == 0:
            raise GenerationError("device 'gpu' requested but no accelerator is available")
        return Accelerator(), DeviceRef.GPU()
    return CPU(), DeviceRef.CPU()


def resolve_dtype(dtype: str | None, default: str = "float32") -> str:
    dtype = default if dtype is None else dtype
    if dtype not in DTYPES:
        raise GenerationError(f"unknown dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    return dtype


def run_dtype(stored: str) -> str:
    """The dtype a checkpoint stored in ``stored`` runs in when none is asked for: its own
    where the engines take it, else float32 (a float16 checkpoint runs as float32)."""
    return stored if stored in DTYPES else next(iter(DTYPES))


def add_device_arguments(parser, dtype_help: str = "weight dtype to run in (default: the checkpoint's)") -> None:
    """``--device`` and ``--dtype`` for a command that loads a model, with these choices."""
    parser.add_argument("--device", default=DEFAULT_DEVICE, choices=DEVICES)
    parser.add_argument("--dtype", default=None, choices=list(DTYPES), help=dtype_help)


# Bytes of a cache line. MAX reads the weights it is given in place, from wherever numpy put
# them; a large numpy array usually starts 16 bytes past a page, so every 64-byte row of a
# packed panel (mojo/decode_step.mojo) would straddle two cache lines.
CACHE_LINE = 64


def cache_aligned(a: np.ndarray) -> np.ndarray:
    """``a`` as a C-contiguous array that starts on a cache line: ``a`` itself when it
    already does, else a copy."""
    a = np.ascontiguousarray(a)
    if a.ctypes.data % CACHE_LINE == 0:
        return a
    raw = np.empty(a.nbytes + CACHE_LINE, np.uint8)
    start = -raw.ctypes.data % CACHE_LINE
    out = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


__all__ = ["CACHE_LINE", "DEFAULT_DEVICE", "DEVICES", "DTYPES", "add_device_arguments", "cache_aligned",
           "check_device_name", "resolve_device", "resolve_dtype", "run_dtype"]
