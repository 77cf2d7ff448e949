"""The weights ``srm-max convert`` reads: which file a source names (a torch or safetensors
file, a Trainer folder, a checkpoint of this project), and its tensors as float32 arrays with
the source's float dtype. torch files are loaded with ``weights_only=True``: a pickle that
would run code, or holds anything but tensors, is refused by name.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from ..errors import CheckpointError, ConvertError
from ..files import check_regular_file
from ..progress import Progress
from .format import WEIGHTS_FILE
from .safetensors_io import FLOAT_DTYPES, SafetensorsFile

TORCH_SUFFIXES = (".pt", ".pth", ".bin")


def resolve_source(src: Path) -> Path:
    """The weights file inside whatever the user pointed at."""
    if not src.exists():
        raise ConvertError(f"{src}: source not found")
    if not src.is_dir():
        check_regular_file(src, ConvertError)
        if src.suffix in TORCH_SUFFIXES or src.suffix == ".safetensors":
            return src
        raise ConvertError(f"{src}: unknown source type {src.suffix!r} (expected .pt, .pth, .bin or .safetensors)")
    for name in (WEIGHTS_FILE, "pytorch_model.bin"):
        if (src / name).exists():  # taken whatever it is, so that a pipe or folder in its place is named
            check_regular_file(src / name, ConvertError)
            return src / name
    steps = sorted(
        (int(m.group(1)), p) for p in src.iterdir() if (m := re.fullmatch(r"checkpoint-(\d+)", p.name)) and p.is_dir()
    )
    if steps:
        return resolve_source(steps[-1][1])
    raise ConvertError(f"{src}: directory holds no {WEIGHTS_FILE}, pytorch_model.bin or checkpoint-N folder")


def read_source(path: Path, show_progress: bool) -> tuple[dict[str, np.ndarray], str]:
    """Raw tensors (float32 numpy) and the source's float dtype name; ``path`` is what
    ``resolve_source`` returned (a regular file, checked there)."""
    if path.suffix == ".safetensors":
        try:
            st = SafetensorsFile(path)
        except CheckpointError as e:
            raise ConvertError(str(e)) from None
        progress = Progress(sum(st.nbytes(k) for k in st.entries), desc=f"reading {path.name}", unit="B",
                            unit_scale=True, enabled=show_progress)
        tensors, dtypes = {}, set()
        with progress:
            for key in st.entries:
                if st.dtype(key) not in ("F32", "F16", "BF16", "F64"):
                    raise ConvertError(f"{path}: tensor {key!r} has unsupported dtype {st.dtype(key)}")
                dtypes.add(st.dtype(key))
                tensors[key] = st.read_float32(key)
                progress.update(st.nbytes(key))
        names = {"F32": "float32", "F64": "float32", "F16": "float16", "BF16": "bfloat16"}
        return tensors, names[dtypes.pop()] if len(dtypes) == 1 else "float32"
    return _read_torch(path)


def _read_torch(path: Path) -> tuple[dict[str, np.ndarray], str]:
    import pickle

    import torch

    if path.stat().st_size == 0:
        raise ConvertError(f"{path}: empty file, not a PyTorch checkpoint")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ConvertError(f"{path}: refused to load: not a plain tensor state dict{_detail(e)}") from None
    except PermissionError as e:  # the file is whole, this user may not read it
        raise ConvertError(f"{path}: cannot be read ({e.strerror or e})") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise ConvertError(f"{path}: cannot read torch file, truncated or corrupt{_detail(e)}") from None
    except Exception as e:  # the weights-only unpickler fails on junk with KeyError, IndexError, ...
        raise ConvertError(f"{path}: not a PyTorch checkpoint{_detail(e, with_type=True)}") from None
    if isinstance(obj, dict) and not any(isinstance(v, torch.Tensor) for v in obj.values()):
        for wrapper in ("state_dict", "model_state_dict", "model"):
            if isinstance(obj.get(wrapper), dict):
                obj = obj[wrapper]
                break
    if not isinstance(obj, dict):
        raise ConvertError(f"{path}: expected a state dict, found {type(obj).__name__}")
    tensors, dtypes = {}, set()
    for key, value in obj.items():
        if not isinstance(key, str):
            raise ConvertError(f"{path}: key {key!r} is a {type(key).__name__}, not a string")
        if not isinstance(value, torch.Tensor):
            raise ConvertError(f"{path}: entry {key!r} is a {type(value).__name__}, not a tensor")
        if not value.is_floating_point():
            raise ConvertError(f"{path}: tensor {key!r} has unsupported dtype {value.dtype}")
        # A meta tensor has no values to convert; a sparse one is not a dense weight matrix.
        if value.is_meta:
            raise ConvertError(f"{path}: tensor {key!r} is on the meta device (it holds no values)")
        if value.layout != torch.strided:
            raise ConvertError(f"{path}: tensor {key!r} has layout {value.layout}; expected a dense tensor")
        dtypes.add(str(value.dtype).removeprefix("torch."))
        try:
            tensors[key] = value.detach().to(torch.float32).numpy()
        except (TypeError, RuntimeError) as e:  # a tensor subclass or storage numpy cannot take
            raise ConvertError(f"{path}: tensor {key!r} cannot be read as an array{_detail(e)}") from None
    source_dtype = dtypes.pop() if len(dtypes) == 1 else "float32"
    return tensors, source_dtype if source_dtype in FLOAT_DTYPES else "float32"


def _detail(error: Exception, with_type: bool = False) -> str:
    """`` (the error's first line)``, the type first if ``with_type`` (a bare ``KeyError``
    says only ``101``); nothing for an error with no message and no type asked for."""
    text = str(error)
    # torch's weights-only error opens with advice to load unsafely; the cause comes after this.
    text = text.split("WeightsUnpickler error:", 1)[-1]
    reason = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if with_type:
        reason = f"{type(error).__name__}: {reason}" if reason else type(error).__name__
    return f" ({reason})" if reason else ""


__all__ = ["TORCH_SUFFIXES", "read_source", "resolve_source"]
