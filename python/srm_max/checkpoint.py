"""The checkpoint directory: ``config.json`` + ``model.safetensors`` (+ ``tokenizer.json``,
``parity.json``).

``load_checkpoint`` validates everything before returning: the config, the
file's integrity, every key and shape against the config, dtypes, and finite
values. Every failure is a ``CheckpointError`` naming the file and the key.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import SRMConfig, load_config
from .errors import CheckpointError
from .safetensors_io import FLOAT_DTYPES, SafetensorsFile, write_safetensors

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
PARITY_FILE = "parity.json"
_DTYPE_NAMES = {code: name for name, code in FLOAT_DTYPES.items()}


def expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every parameter of the model, by key name, with its shape.

    SRM keys are the paper code's (``MLPMixer``); PHA's are in ``pha_config``.
    """
    if config.architecture == "pha":
        from .pha_config import pha_expected_shapes

        return pha_expected_shapes(config)
    d, f, n, hd = config.d_model, config.ffn_dim, config.context_length, config.head_dim
    shapes = {"input_layer.weight": (config.vocab_size, d), "output_layer.weight": (config.vocab_size, d)}
    for l in range(config.n_layers):
        p = f"mixer_blocks.{l}."
        shapes |= {
            p + "channel_norm.weight": (d,),
            p + "channel_norm.bias": (d,),
            p + "channel_mixing_layer.0.weight": (f, d),
            p + "channel_mixing_layer.0.bias": (f,),
            p + "channel_mixing_layer.2.weight": (d, f),
            p + "channel_mixing_layer.2.bias": (d,),
            p + "token_norm.weight": (d,),
            p + "token_norm.bias": (d,),
            p + "token_mixing_layer.out_proj.weight": (d, d),
            p + "token_mixing_layer.out_proj.bias": (d,),
        }
        for h in range(config.n_heads):
            q = p + "token_mixing_layer."
            shapes |= {
                q + f"proj_head.{h}.weight": (hd, d),
                q + f"proj_head.{h}.bias": (hd,),
                q + f"mixer_heads.{h}.weight": (1, n),
                q + f"mixer_heads.{h}.bias": (n,),
            }
            if config.decay:
                shapes[q + f"mixer_heads.{h}.decay_value"] = (1,)
    return shapes


def check_weights(config: SRMConfig, shapes: dict[str, tuple[int, ...]], source: str) -> None:
    """Keys and shapes against the config: missing, unexpected, or disagreeing."""
    expected = expected_shapes(config)
    missing = [k for k in expected if k not in shapes]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{source}: missing key {missing[0]!r}{more}")
    unexpected = [k for k in shapes if k not in expected]
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(f"{source}: unexpected key {unexpected[0]!r}{more}")
    for key, shape in expected.items():
        if tuple(shapes[key]) != shape:
            raise CheckpointError(
                f"{source}: {key!r} has shape {list(shapes[key])} but the config implies {list(shape)} "
                f"(config and tensors disagree)"
            )


def check_finite(name: str, array: np.ndarray, source: str) -> None:
    if not np.isfinite(array).all():
        bad = "NaN" if np.isnan(array).any() else "Inf"
        raise CheckpointError(f"{source}: tensor {name!r} contains {bad} values")


@dataclass
class Checkpoint:
    path: Path
    config: SRMConfig  # or PHAConfig, by its architecture field
    weights: dict[str, np.ndarray]  # float32, the paper's key names
    dtype: str  # as stored: float32, bfloat16 or float16
    tokenizer_path: Path | None


def load_checkpoint(path: str | Path) -> Checkpoint:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory (expected {CONFIG_FILE} and {WEIGHTS_FILE})")
    config = load_config(path / CONFIG_FILE)
    weights_path = path / WEIGHTS_FILE
    if not weights_path.exists():
        raise CheckpointError(f"{weights_path}: weights file not found")
    st = SafetensorsFile(weights_path)
    check_weights(config, {k: st.shape(k) for k in st.entries}, str(weights_path))
    dtypes = {st.dtype(k) for k in st.entries}
    unsupported = dtypes - set(_DTYPE_NAMES)
    if unsupported:
        key = next(k for k in st.entries if st.dtype(k) in unsupported)
        raise CheckpointError(
            f"{weights_path}: tensor {key!r} has unsupported dtype {st.dtype(key)} "
            f"(supported: {', '.join(FLOAT_DTYPES)})"
        )
    if len(dtypes) > 1:
        raise CheckpointError(f"{weights_path}: mixed dtypes {sorted(dtypes)}; expected one")
    weights = {}
    for key in st.entries:
        weights[key] = st.read_float32(key)
        check_finite(key, weights[key], str(weights_path))
    tokenizer = path / TOKENIZER_FILE
    return Checkpoint(path, config, weights, _DTYPE_NAMES[dtypes.pop()], tokenizer if tokenizer.exists() else None)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def exchange_paths(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``);
    False where the C library, kernel or file system does not offer it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _swap_into_place(tmp: Path, destination: Path) -> None:
    """Make the complete ``tmp`` the ``destination``.

    A new destination is one rename. An existing one is exchanged with ``tmp`` in one
    atomic step, so at every instant ``destination`` is the complete old or the complete
    new directory; ``tmp`` then holds the old one and is removed. Where no atomic
    exchange exists (not Linux, or a file system without it) the old directory is first
    renamed aside: a kill between the two renames leaves ``destination`` missing and the
    old model in a hidden ``.name.old-*/old`` folder beside it.
    """
    if not destination.exists():
        os.replace(tmp, destination)
    elif not exchange_paths(tmp, destination):
        backup = Path(tempfile.mkdtemp(prefix=f".{destination.name}.old-", dir=destination.parent))
        os.replace(destination, backup / "old")
        os.replace(tmp, destination)
        shutil.rmtree(backup, ignore_errors=True)


@contextmanager
def atomic_directory(destination: str | Path, force: bool = False):
    """Yield a temporary directory beside ``destination``; on success it replaces it.

    Nothing is overwritten without ``force``; on any error (or a kill) the old
    destination stays whole and the temporary directory is removed (or, after a
    kill, left as a hidden ``.name.tmp-*`` that is never mistaken for a model).
    The replacement itself is atomic where the system can exchange two
    directories (``_swap_into_place``).
    """
    destination = Path(destination)
    if destination.exists() and not force:
        raise CheckpointError(f"{destination}: already exists (use --force to overwrite)")
    destination.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{destination.name}.tmp-", dir=destination.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; a model directory is not
    try:
        yield tmp
        _swap_into_place(tmp, destination)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_checkpoint_files(
    directory: Path, config: SRMConfig, weights: dict[str, np.ndarray], dtype: str, tokenizer: Path | None = None
) -> None:
    """Write the files of a checkpoint into an (empty, temporary) directory."""
    if dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"unsupported dtype {dtype!r} (supported: {', '.join(FLOAT_DTYPES)})")
    check_weights(config, {k: v.shape for k, v in weights.items()}, "weights")
    config.save(directory / CONFIG_FILE)
    write_safetensors(directory / WEIGHTS_FILE, weights, dtype, metadata={"format": "srm-max"})
    if tokenizer is not None:
        shutil.copyfile(tokenizer, directory / TOKENIZER_FILE)


def save_checkpoint(
    path: str | Path,
    config: SRMConfig,
    weights: dict[str, np.ndarray],
    dtype: str = "float32",
    tokenizer: str | Path | None = None,
    force: bool = False,
) -> Path:
    """Write a checkpoint directory atomically (no parity certificate: see ``convert``)."""
    with atomic_directory(path, force) as tmp:
        write_checkpoint_files(tmp, config, weights, dtype, Path(tokenizer) if tokenizer else None)
    return Path(path)
