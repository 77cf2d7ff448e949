"""``srm-max convert SRC DST``: a checkpoint of any registered architecture -> the project's
format, verified.

Accepted sources (read by ``sources.py``):
  * a torch state-dict file (``.pt``, ``.pth``, ``.bin``), loaded with ``weights_only=True``;
  * a ``.safetensors`` file;
  * a directory: a Hugging Face Trainer checkpoint (``checkpoint-N/model.safetensors`` or
    ``pytorch_model.bin``), a Trainer output folder holding ``checkpoint-N`` folders
    (the highest N is taken), or a checkpoint in this project's format.

The config comes from ``--config`` if given, else from a ``config.json`` of this
project's format beside the weights (one there that is not JSON is refused), else the
architecture's weight adapter infers it from the shapes where it can (the SRM's can; the
PHA's needs a config). An inferred
config that is invalid, or that the other tensors disagree with, is reported with the
tensors it was read off, since one of those may be the tensor with the wrong shape.

Key mapping (``normalize_keys``): ``module.`` (DDP) and ``_orig_mod.`` (torch.compile)
prefixes are removed, in any nesting and order (``_orig_mod.module.`` is torch.compile
over DDP); the rest is the architecture's own weight adapter
(``models/<arch>/weight_adapter.py``: the paper code's keys, the layouts it refuses, the
config read off the shapes). Everything else must match the architecture's schema
exactly, or the key is named.

The parity certificate compares the converted model with the source's own forward
where ``source_forward`` can rebuild it (see ``parity``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

from .. import __version__
from .format import (PARITY_FILE, TOKENIZER_FILE, WEIGHTS_FILE, atomic_directory, check_finite, check_weights,
                     write_checkpoint_files)
from ..files import check_replaceable
from ..models import registry
from ..models.config_io import read_json, unknown_fields
from ..models.registry import config_from_dict, load_config
from ..errors import CheckpointError, ConvertError
from .parity import SourceForward, check_parity_tokens, compute_parity, reference_class
from .safetensors_io import FLOAT_DTYPES
from .sources import read_source, resolve_source
from .tokenizer import check_vocabulary, read_tokenizer

_PREFIXES = ("module.", "_orig_mod.")


def split_prefixes(key: str) -> tuple[tuple[str, ...], str]:
    """(the wrapper attributes, outermost first, the key inside them):
    ``_orig_mod.module.x`` -> (("_orig_mod", "module"), "x")."""
    wrappers = []
    while prefix := next((p for p in _PREFIXES if key.startswith(p)), None):
        wrappers.append(prefix[:-1])
        key = key[len(prefix):]
    return tuple(wrappers), key


def normalize_keys(tensors: dict[str, np.ndarray], source: str) -> dict[str, np.ndarray]:
    """Wrapper prefixes removed; then the keys of the architecture they belong to mapped to
    ours by its weight adapter (``models/<arch>/weight_adapter.py``)."""
    out, origin = {}, {}
    for key, value in tensors.items():
        new = split_prefixes(key)[1]
        if new in out:
            raise ConvertError(f"{source}: keys {origin[new]!r} and {key!r} both map to {new!r}")
        out[new], origin[new] = value, key
    arch = registry.recognize(out)
    return arch.weight_adapter.normalize(out, source) if arch else out


def check_supported_layout(tensors: dict[str, np.ndarray], source: str) -> None:
    """Refuse, by name, a source layout its architecture's adapter cannot serve."""
    if arch := registry.recognize(tensors):
        arch.weight_adapter.check_supported(tensors, source)


class _ShapeReads(dict):
    """The source's tensors, remembering which ones were looked up (by a weight adapter
    inferring the config), in order."""

    def __init__(self, tensors: dict[str, np.ndarray]):
        super().__init__(tensors)
        self.read: list[str] = []

    def __getitem__(self, key: str) -> np.ndarray:
        if key not in self.read:
            self.read.append(key)
        return super().__getitem__(key)


def choose_config(tensors: dict[str, np.ndarray], weights_path: Path, config_path: Path | None,
                  overrides: dict | None):
    """The config to convert with (given, found beside the weights, or inferred), and the
    tensors whose shapes it was inferred from (none when it was read from a file)."""
    beside = weights_path.parent / "config.json"
    if config_path is None and _ours_beside(beside):
        config_path = beside
    if config_path is None:
        arch = registry.recognize(tensors) or registry.get(registry.DEFAULT)
        _check_overrides(arch.config, overrides)
        seen = _ShapeReads(tensors)
        try:
            return arch.weight_adapter.infer_config(seen, str(weights_path), overrides), seen.read
        except ConvertError as e:
            if not seen.read:
                raise
            raise ConvertError(f"{e}; {_inferred_from(tensors, seen.read)}") from None
    try:
        base = load_config(config_path)
        _check_overrides(type(base), overrides)
        return config_from_dict(base.to_dict() | (overrides or {}), source=str(config_path)), []
    except CheckpointError as e:
        raise ConvertError(str(e)) from None


def _check_overrides(config_class, overrides: dict | None) -> None:
    """Refuse an ``--override`` naming no field of the config, before anything is built with it."""
    problem = unknown_fields(config_class, overrides or {})
    if problem:
        raise ConvertError(f"--override: {problem}")


def _inferred_from(tensors: dict[str, np.ndarray], keys: list[str]) -> str:
    shapes = ", ".join(f"{key!r} {list(tensors[key].shape)}" for key in keys if key in tensors)
    return f"the config was inferred from {shapes}; pass --config if one of these has the wrong shape"


def _names_ours(data) -> bool:
    return isinstance(data, dict) and data.get("architecture") in registry.names()


def _ours_beside(path: Path) -> bool:
    """Whether the config.json beside the weights is this project's (another tool's JSON is left
    to the shapes); ``ConvertError`` when one lies there but cannot be read as JSON (a pipe, junk,
    no permission): likely the run's own config, damaged, which the shapes would silently stand
    in for (they do not tell every field)."""
    if not os.path.lexists(path):
        return False
    try:
        return _names_ours(read_json(path, ConvertError))
    except ConvertError as e:
        raise ConvertError(f"{e}; pass --config, or move it away to infer the config from the weights' "
                           "shapes") from None


def _is_ours(path: Path) -> bool:
    """A config.json of this project (not, say, a Trainer's own); never one that is not a
    regular file (a named pipe would block the read)."""
    if not path.is_file():
        return False
    try:
        return _names_ours(read_json(path))
    except CheckpointError:
        return False


def parse_override(text: str) -> tuple[str, object]:
    """``key=value`` with a JSON value (``decay=false``, ``layer_norm_eps=1e-6``)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ConvertError(f"override {text!r}: expected KEY=VALUE")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        raise ConvertError(f"override {key!r}: value {_shorten(value)} is not valid JSON") from None
    except (ValueError, RecursionError):  # an int of more digits than Python converts, or deep nesting
        raise ConvertError(f"override {key!r}: value {_shorten(value)} is too large or too deeply nested") from None


def _shorten(text: str, limit: int = 60) -> str:
    """``text`` quoted, cut to ``limit`` characters so that a huge argument does not flood the error."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


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
    try:  # before any work; atomic_directory checks again when it writes
        check_replaceable(dst, force)
    except CheckpointError as e:
        raise ConvertError(str(e)) from None
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise ConvertError(f"--dtype {dtype!r}: expected one of {', '.join(FLOAT_DTYPES)}")
    check_parity_tokens(parity_tokens, "--parity-tokens", ConvertError)
    check_apart(src, dst)
    weights_path = resolve_source(src)
    check_apart(weights_path, dst)  # a checkpoint-N folder may be a link to somewhere else
    if tokenizer is None:
        tokenizer = tokenizer_beside(weights_path)
    tokenizer_read = read_tokenizer(tokenizer, ConvertError) if tokenizer is not None else None
    if show_progress is None:
        show_progress = sys.stderr.isatty() and weights_path.stat().st_size > 64 * 2**20
    raw, source_dtype = read_source(weights_path, show_progress)
    tensors = normalize_keys(raw, str(weights_path))
    check_supported_layout(tensors, str(weights_path))
    config, inferred_from = choose_config(tensors, weights_path, Path(config) if config else None, overrides)
    try:
        check_weights(config, {k: v.shape for k, v in tensors.items()}, str(weights_path))
    except CheckpointError as e:
        raise ConvertError(f"{e}; {_inferred_from(tensors, inferred_from)}" if inferred_from else str(e)) from None
    try:
        for key, value in tensors.items():
            check_finite(key, value, str(weights_path))
    except CheckpointError as e:
        raise ConvertError(str(e)) from None
    if tokenizer_read is not None:
        check_vocabulary(tokenizer_read, config.vocab_size, ConvertError, str(tokenizer))
    dtype = dtype or source_dtype
    source = source_forward(config, raw, dtype)

    try:
        with atomic_directory(dst, force) as tmp:
            certificate = _write_and_certify(tmp, src, config, tensors, dtype, tokenizer, parity_tokens, source)
    except OSError as e:  # a full disk, a read-only folder: the old DST (if any) is untouched
        raise ConvertError(f"{dst}: cannot write ({e.strerror or e}); nothing was written") from None
    return certificate


def check_apart(src: Path, dst: Path) -> None:
    """Refuse an output that is the source, holds it or lies inside it: with ``--force`` the
    output directory is replaced as a whole, so the source and whatever sits beside it (its
    tokenizer, other checkpoints) would be lost. Compared as real paths, so links and ``..``
    cannot hide the overlap."""
    source, output = src.resolve(), dst.resolve()
    if output == source or output in source.parents:
        raise ConvertError(f"{dst}: the output would replace the source {src} (it is the source or holds it); "
                           "choose another output path")
    if source in output.parents:
        raise ConvertError(f"{dst}: the output lies inside the source {src}; choose a path outside it")


def tokenizer_beside(weights_path: Path) -> Path | None:
    """The tokenizer.json of a source that is a checkpoint of this project's format, so that
    converting it (to another dtype, say) keeps its tokenizer; None for any other source."""
    folder = weights_path.parent
    if weights_path.name == WEIGHTS_FILE and (folder / TOKENIZER_FILE).is_file() and _is_ours(folder / "config.json"):
        return folder / TOKENIZER_FILE
    return None


def source_forward(config, raw: dict[str, np.ndarray], dtype: str) -> SourceForward:
    """The source checkpoint's own model, built without ``normalize_keys``.

    The reference class is rebuilt in the source's module layout (the weight adapter's
    ``source_layout``, e.g. the paper code's dropout channel MLP), inside containers
    named by the DDP / torch.compile prefixes. torch then binds each parameter to the key as stored, so a mapping
    error in the converter shows up as different logits. The tensors are rounded to
    the written dtype (rounding is per element, so it commutes with any renaming),
    which makes the two models' float64 logits equal when the mapping is right.
    """
    import torch
    import torch.nn as nn

    chains = {split_prefixes(key)[0] for key in raw}
    if len(chains) != 1:
        listed = ", ".join(sorted(repr("".join(w + "." for w in chain)) for chain in chains))
        return SourceForward(None, f"the keys carry different wrapper prefixes ({listed}); no single "
                                   "module layout holds them all")
    (chain,) = chains
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    state = {k: torch.from_numpy(np.asarray(v)).to(torch_dtype).to(torch.float64) for k, v in raw.items()}

    with torch.device("meta"):
        model = reference_class(config)(config)
        relaid = registry.of(config).weight_adapter.source_layout(model, config, raw)
        root = model
        for name in reversed(chain):
            wrapper = nn.Module()
            wrapper.add_module(name, root)
            root = wrapper
    try:
        root.load_state_dict(state, assign=True)
    except RuntimeError as e:
        return SourceForward(None, f"the source's keys do not load into the rebuilt model: {str(e).splitlines()[0]}")
    layout = f"srm_max.reference {type(model).__name__}{relaid}"
    if chain:
        layout += " inside " + ".".join(chain)
    return SourceForward(model.eval(), layout)


def _write_and_certify(tmp: Path, src: Path, config, tensors, dtype, tokenizer, parity_tokens, source) -> dict:
    write_checkpoint_files(tmp, config, tensors, dtype, Path(tokenizer) if tokenizer else None)
    # Certify what was written, read back through the real loader.
    from .format import load_checkpoint

    written = load_checkpoint(tmp)
    certificate = compute_parity(config, written.weights, tokens=parity_tokens, source=source)
    certificate |= {"source": str(src.resolve()), "dtype": dtype, "srm_max": __version__,
                    "config": config.to_dict(), "weights_sha256": file_sha256(tmp / WEIGHTS_FILE)}
    (tmp / PARITY_FILE).write_text(json.dumps(certificate, indent=2) + "\n")
    checked = certificate.get("source_forward")
    if checked is not None and not checked["passed"]:
        raise ConvertError(
            f"{src}: source-forward check failed: the converted model's logits differ from the source's own "
            f"forward by {checked['max_abs_delta']:.3g} (tolerance {checked['tolerance']:.3g}), so the key "
            "mapping is wrong; nothing was written"
        )
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
