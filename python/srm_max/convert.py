"""``srm-max convert SRC DST``: any SRM checkpoint -> the project's format, verified.

Accepted sources:
  * a torch state-dict file (``.pt``, ``.pth``, ``.bin``), loaded with ``weights_only=True``;
  * a ``.safetensors`` file;
  * a directory: a Hugging Face Trainer checkpoint (``checkpoint-N/model.safetensors`` or
    ``pytorch_model.bin``), a Trainer output folder holding ``checkpoint-N`` folders
    (the highest N is taken), or a checkpoint in this project's format.

The config comes from ``--config`` if given, else from a ``config.json`` of this
project's format beside the weights, else (SRM only) it is inferred from the
shapes. PHA checkpoints (keys ``embed.weight``, ``blocks.*``) need a config.

Key mapping (the paper code's ``MLPMixer``, all in ``normalize_keys``):
  * ``module.`` (DDP) and ``_orig_mod.`` (torch.compile) prefixes are removed;
  * a dropout layer in the channel MLP moves ``channel_mixing_layer.2`` to ``.3``: mapped back;
  * no ``decay_value`` keys means a model without decay (lam = 1).
Everything else must match ``checkpoint.expected_shapes`` exactly, or the key is named.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

from . import __version__
from .checkpoint import (
    PARITY_FILE,
    WEIGHTS_FILE,
    atomic_directory,
    check_finite,
    check_weights,
    write_checkpoint_files,
)
from .config import SRMConfig, config_from_dict, load_config
from .errors import CheckpointError, ConvertError
from .parity import compute_parity
from .safetensors_io import FLOAT_DTYPES, SafetensorsFile

TORCH_SUFFIXES = (".pt", ".pth", ".bin")
_PREFIXES = ("module.", "_orig_mod.")
_BLOCK = re.compile(r"^mixer_blocks\.(\d+)\.")
_HEAD = re.compile(r"^mixer_blocks\.0\.token_mixing_layer\.proj_head\.(\d+)\.weight$")


class Progress:
    """A one-line progress display on stderr, shown only for large work."""

    def __init__(self, label: str, total_bytes: int, enabled: bool):
        self.label, self.total, self.done = label, max(total_bytes, 1), 0
        self.enabled = enabled
        self.last = 0.0

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if self.enabled and (now - self.last > 0.2 or self.done >= self.total):
            self.last = now
            pct = 100 * self.done / self.total
            print(f"\r{self.label}: {pct:5.1f}% ({self.done / 2**20:.0f}/{self.total / 2**20:.0f} MiB)",
                  end="\n" if self.done >= self.total else "", file=sys.stderr, flush=True)


def resolve_source(src: Path) -> Path:
    """The weights file inside whatever the user pointed at."""
    if not src.exists():
        raise ConvertError(f"{src}: source not found")
    if src.is_file():
        if src.suffix in TORCH_SUFFIXES or src.suffix == ".safetensors":
            return src
        raise ConvertError(f"{src}: unknown source type {src.suffix!r} (expected .pt, .pth, .bin or .safetensors)")
    for name in (WEIGHTS_FILE, "pytorch_model.bin"):
        if (src / name).is_file():
            return src / name
    steps = sorted(
        (int(m.group(1)), p) for p in src.iterdir() if (m := re.fullmatch(r"checkpoint-(\d+)", p.name)) and p.is_dir()
    )
    if steps:
        return resolve_source(steps[-1][1])
    raise ConvertError(f"{src}: directory holds no {WEIGHTS_FILE}, pytorch_model.bin or checkpoint-N folder")


def read_source(path: Path, show_progress: bool) -> tuple[dict[str, np.ndarray], str]:
    """Raw tensors (float32 numpy) and the source's float dtype name."""
    if path.suffix == ".safetensors":
        try:
            st = SafetensorsFile(path)
        except CheckpointError as e:
            raise ConvertError(str(e)) from None
        progress = Progress(f"reading {path.name}", sum(st.nbytes(k) for k in st.entries), show_progress)
        tensors, dtypes = {}, set()
        for key in st.entries:
            if st.dtype(key) not in ("F32", "F16", "BF16", "F64"):
                raise ConvertError(f"{path}: tensor {key!r} has unsupported dtype {st.dtype(key)}")
            dtypes.add(st.dtype(key))
            tensors[key] = st.read_float32(key)
            progress.advance(st.nbytes(key))
        names = {"F32": "float32", "F64": "float32", "F16": "float16", "BF16": "bfloat16"}
        return tensors, names[dtypes.pop()] if len(dtypes) == 1 else "float32"
    return _read_torch(path)


def _read_torch(path: Path) -> tuple[dict[str, np.ndarray], str]:
    import pickle

    import torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ConvertError(f"{path}: refused to load: not a plain tensor state dict ({str(e).splitlines()[0]})") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise ConvertError(f"{path}: cannot read torch file (truncated or corrupt?): {str(e).splitlines()[0]}") from None
    if isinstance(obj, dict) and not any(isinstance(v, torch.Tensor) for v in obj.values()):
        for wrapper in ("state_dict", "model_state_dict", "model"):
            if isinstance(obj.get(wrapper), dict):
                obj = obj[wrapper]
                break
    if not isinstance(obj, dict):
        raise ConvertError(f"{path}: expected a state dict, found {type(obj).__name__}")
    tensors, dtypes = {}, set()
    for key, value in obj.items():
        if not isinstance(value, torch.Tensor):
            raise ConvertError(f"{path}: entry {key!r} is a {type(value).__name__}, not a tensor")
        if not value.is_floating_point():
            raise ConvertError(f"{path}: tensor {key!r} has unsupported dtype {value.dtype}")
        dtypes.add(str(value.dtype).removeprefix("torch."))
        tensors[key] = value.detach().to(torch.float32).numpy()
    source_dtype = dtypes.pop() if len(dtypes) == 1 else "float32"
    return tensors, source_dtype if source_dtype in FLOAT_DTYPES else "float32"


def normalize_keys(tensors: dict[str, np.ndarray], source: str) -> dict[str, np.ndarray]:
    out = {}
    for key, value in tensors.items():
        new = key
        for prefix in _PREFIXES:
            new = new.removeprefix(prefix)
        out[new] = value
    has_dropout = any(".channel_mixing_layer.3." in k for k in out)
    if has_dropout:
        if any(".channel_mixing_layer.2." in k for k in out):
            raise ConvertError(f"{source}: both channel_mixing_layer.2 and .3 present; cannot map the channel MLP")
        out = {k.replace(".channel_mixing_layer.3.", ".channel_mixing_layer.2."): v for k, v in out.items()}
    return out


def infer_config(tensors: dict[str, np.ndarray], source: str, overrides: dict | None = None) -> SRMConfig:
    """V, d, L, H, n, FFN expansion and decay from the shapes; ``overrides`` win."""

    def shape(key: str, rank: int) -> tuple[int, ...]:
        if key not in tensors:
            raise ConvertError(f"{source}: missing key {key!r}; cannot infer the model's size")
        if tensors[key].ndim != rank or 0 in tensors[key].shape:
            raise ConvertError(f"{source}: {key!r} has shape {list(tensors[key].shape)}; expected {rank} non-empty dims")
        return tensors[key].shape

    vocab, d = shape("input_layer.weight", 2)
    layers = {int(m.group(1)) for k in tensors if (m := _BLOCK.match(k))}
    heads = {int(m.group(1)) for k in tensors if (m := _HEAD.match(k))}
    if not layers:
        raise ConvertError(f"{source}: no mixer_blocks.* keys; not an SRM checkpoint")
    if not heads:
        raise ConvertError(f"{source}: missing key 'mixer_blocks.0.token_mixing_layer.proj_head.0.weight'")
    ffn = shape("mixer_blocks.0.channel_mixing_layer.0.weight", 2)[0]
    n = shape("mixer_blocks.0.token_mixing_layer.mixer_heads.0.weight", 2)[-1]
    values = {
        "vocab_size": vocab,
        "d_model": d,
        "n_layers": max(layers) + 1,
        "n_heads": max(heads) + 1,
        "context_length": n,
        "ffn_expansion": max(1, ffn // d),
        "decay": any(k.endswith(".decay_value") for k in tensors),
    }
    values |= overrides or {}
    try:
        return SRMConfig(**values)
    except (CheckpointError, TypeError) as e:
        raise ConvertError(f"{source}: {e}") from None


def choose_config(tensors: dict[str, np.ndarray], weights_path: Path, config_path: Path | None,
                  overrides: dict | None):
    """The config to convert with: given, found beside the weights, or inferred (SRM)."""
    beside = weights_path.parent / "config.json"
    if config_path is None and beside.is_file() and _is_ours(beside):
        config_path = beside
    if config_path is None:
        if "embed.weight" in tensors or any(k.startswith("blocks.") for k in tensors):
            raise ConvertError(f"{weights_path}: a PHA checkpoint; pass its config.json with --config")
        return infer_config(tensors, str(weights_path), overrides)
    try:
        base = load_config(config_path).to_dict()
        return config_from_dict(base | (overrides or {}), source=str(config_path))
    except CheckpointError as e:
        raise ConvertError(str(e)) from None


def _is_ours(path: Path) -> bool:
    """A config.json of this project (not, say, a Trainer's own)."""
    try:
        return json.loads(path.read_text()).get("architecture") in ("srm", "pha")
    except (ValueError, AttributeError, OSError, RecursionError):
        return False


def parse_override(text: str) -> tuple[str, object]:
    """``key=value`` with a JSON value (``decay=false``, ``layer_norm_eps=1e-6``)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ConvertError(f"override {text!r}: expected KEY=VALUE")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        raise ConvertError(f"override {text!r}: value {value!r} is not valid JSON") from None


def convert(
    src: str | Path,
    dst: str | Path,
    dtype: str | None = None,
    tokenizer: str | Path | None = None,
    overrides: dict | None = None,
    config: str | Path | None = None,
    force: bool = False,
    parity_tokens: int | None = None,
    show_progress: bool | None = None,
) -> dict:
    """Convert, verify and write atomically. Returns the parity certificate."""
    src, dst = Path(src), Path(dst)
    if dst.exists() and not force:
        raise ConvertError(f"{dst}: already exists (use --force to overwrite)")
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise ConvertError(f"--dtype {dtype!r}: expected one of {', '.join(FLOAT_DTYPES)}")
    if tokenizer is not None:
        _check_tokenizer(Path(tokenizer))
    weights_path = resolve_source(src)
    if show_progress is None:
        show_progress = sys.stderr.isatty() and weights_path.stat().st_size > 64 * 2**20
    tensors, source_dtype = read_source(weights_path, show_progress)
    tensors = normalize_keys(tensors, str(weights_path))
    config = choose_config(tensors, weights_path, Path(config) if config else None, overrides)
    try:
        check_weights(config, {k: v.shape for k, v in tensors.items()}, str(weights_path))
        for key, value in tensors.items():
            check_finite(key, value, str(weights_path))
    except CheckpointError as e:
        raise ConvertError(str(e)) from None
    if tokenizer is not None:
        _check_tokenizer(Path(tokenizer), config.vocab_size)
    dtype = dtype or source_dtype

    try:
        with atomic_directory(dst, force) as tmp:
            certificate = _write_and_certify(tmp, src, config, tensors, dtype, tokenizer, parity_tokens)
    except OSError as e:  # a full disk, a read-only folder: the old DST (if any) is untouched
        raise ConvertError(f"{dst}: cannot write ({e.strerror or e}); nothing was written") from None
    return certificate


def _write_and_certify(tmp: Path, src: Path, config, tensors, dtype, tokenizer, parity_tokens) -> dict:
    write_checkpoint_files(tmp, config, tensors, dtype, Path(tokenizer) if tokenizer else None)
    # Certify what was written, read back through the real loader.
    from .checkpoint import load_checkpoint

    written = load_checkpoint(tmp)
    certificate = compute_parity(config, written.weights, tokens=parity_tokens)
    certificate |= {"source": str(src.resolve()), "dtype": dtype, "srm_max": __version__,
                    "config": config.to_dict(), "weights_sha256": file_sha256(tmp / WEIGHTS_FILE)}
    (tmp / PARITY_FILE).write_text(json.dumps(certificate, indent=2) + "\n")
    if not certificate["passed"]:
        raise ConvertError(
            f"{src}: parity check failed: {certificate['max_abs_delta']} exceeds {certificate['tolerance']:.3g}; "
            "nothing was written"
        )
    return certificate


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _check_tokenizer(path: Path, vocab_size: int | None = None) -> None:
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exception subclasses
        raise ConvertError(f"{path}: not a valid tokenizer.json ({str(e).splitlines()[0]})") from None
    if vocab_size is not None and tok.get_vocab_size() > vocab_size:
        raise ConvertError(
            f"{path}: tokenizer has {tok.get_vocab_size()} tokens but the model's vocabulary is {vocab_size}"
        )
