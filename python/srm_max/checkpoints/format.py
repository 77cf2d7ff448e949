"""The checkpoint directory: ``config.json`` + ``model.safetensors`` (+ ``tokenizer.json``,
``parity.json``).

``load_checkpoint`` validates everything before returning: the config, the
file's integrity, every key and shape against the config, dtypes, and finite
values. Every failure is a ``CheckpointError`` naming the file and the key.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..models import registry
from ..models.registry import load_config
from ..models.architecture import ModelConfig
from ..errors import CheckpointError
from ..files import atomic_directory, check_regular_file
from ..weight_shapes import shape_problem
from .safetensors_io import FLOAT_DTYPES, SafetensorsFile, write_safetensors

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # beside tokenizer.json, the Hugging Face convention
END_OF_TEXT = "<|endoftext|>"  # the document separator `srm-max train` writes
PARITY_FILE = "parity.json"
_DTYPE_NAMES = {code: name for name, code in FLOAT_DTYPES.items()}


def expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every parameter of the model, by key name, with its shape (its architecture's schema)."""
    return registry.of(config).checkpoint_shapes(config)


def check_weights(config: ModelConfig, shapes: dict[str, tuple[int, ...]], source: str) -> None:
    """Keys and shapes against the config: missing, unexpected, or disagreeing."""
    problem = shape_problem(expected_shapes(config), shapes)
    if problem:
        raise CheckpointError(f"{source}: {problem}")


def check_finite(name: str, array: np.ndarray, source: str) -> None:
    if not np.isfinite(array).all():
        bad = "NaN" if np.isnan(array).any() else "Inf"
        raise CheckpointError(f"{source}: tensor {name!r} contains {bad} values")


@dataclass
class Checkpoint:
    path: Path
    config: ModelConfig  # the architecture's own config class
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


def write_checkpoint_files(
    directory: Path, config: ModelConfig, weights: dict[str, np.ndarray], dtype: str, tokenizer: Path | None = None
) -> None:
    """Write the files of a checkpoint into an (empty, temporary) directory."""
    if dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"unsupported dtype {dtype!r} (supported: {', '.join(FLOAT_DTYPES)})")
    check_weights(config, {k: v.shape for k, v in weights.items()}, "weights")
    config.save(directory / CONFIG_FILE)
    write_safetensors(directory / WEIGHTS_FILE, weights, dtype, metadata={"format": "srm-max"})
    if tokenizer is not None:
        check_regular_file(tokenizer)
        shutil.copyfile(tokenizer, directory / TOKENIZER_FILE)
        write_tokenizer_config(directory, config.context_length, Path(tokenizer).parent / TOKENIZER_CONFIG_FILE)


def write_tokenizer_config(directory: Path, context_length: int, source: Path | None = None) -> Path:
    """``tokenizer_config.json`` beside the directory's tokenizer.json, so that
    ``transformers.AutoTokenizer.from_pretrained(directory)`` loads the tokenizer with its
    end-of-text token (lm-eval's ``local-completions`` model reads it so): a copy of
    ``source`` when the tokenizer came with one (its chat template included), else the
    fast tokenizer class, ``<|endoftext|>`` as eos when the vocabulary has it, and the
    context length as ``model_max_length``."""
    target = directory / TOKENIZER_CONFIG_FILE
    if source is not None and source.is_file():
        shutil.copyfile(source, target)
        return target
    tokenizer = json.loads((directory / TOKENIZER_FILE).read_text())
    special = {t.get("content") for t in tokenizer.get("added_tokens") or []}
    body = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": context_length,
            "clean_up_tokenization_spaces": False}
    if END_OF_TEXT in special or END_OF_TEXT in (tokenizer.get("model", {}).get("vocab") or {}):
        body["eos_token"] = END_OF_TEXT
    target.write_text(json.dumps(body, indent=2) + "\n")
    return target


def save_checkpoint(
    path: str | Path,
    config: ModelConfig,
    weights: dict[str, np.ndarray],
    dtype: str = "float32",
    tokenizer: str | Path | None = None,
    force: bool = False,
) -> Path:
    """Write a checkpoint directory atomically (no parity certificate: see ``convert``)."""
    with atomic_directory(path, force) as tmp:
        write_checkpoint_files(tmp, config, weights, dtype, Path(tokenizer) if tokenizer else None)
    return Path(path)
