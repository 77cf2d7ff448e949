"""The parity certificate (``parity.json``) and what it proves.

Internal consistency: SRM's naive (dense n x n), parallel (scan) and recurrent
(step by step) token-mixer forms; PHA's GSS branch as FFT convolution and as
recurrence, and prefill + step-by-step decode with the KV cache. All run on
random tokens, in float64, from the weights as they were written; the
certificate records the largest |logit difference| of each pair. Every form
reads the same tensors under the same names, so a wrong key mapping (two heads
swapped, say) passes this check.

Source forward: where the converter can rebuild the source checkpoint's own
model (the reference class, in the source's module layout, its parameters
bound by torch from the keys as stored), that model runs on the same tokens and
its logits are compared with the converted model's. This is what catches a
wrong key mapping. It shows the mapping preserves the function the reference
computes on the source's parameter names; that the reference computes what the
paper's code computes is tested separately (``tests/reference/test_reference.py``).
"""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..models import registry
from ..models.architecture import ModelConfig
from ..errors import CheckpointError, SRMError
from ..files import check_regular_file
from ..scalars import is_int, is_plain_int

# float64 work, so disagreement beyond rounding means a broken model or mixer.
RELATIVE_TOLERANCE = 1e-9
DEFAULT_TOKENS = 256  # per sequence, capped at the model's context length
# Far above the batch convert writes (2); it stops a hostile certificate from asking for absurd work.
MAX_BATCH = 64
PROVES_INTERNAL = (
    "internal consistency of the converted weights: the reference's {forms} forms give the same "
    "logits on them (max_abs_delta); every form reads the same tensors under the same names, so "
    "this alone cannot catch a wrong key mapping"
)
PROVES_SOURCE = (
    "; source_forward: the converted model's logits equal those of the source checkpoint's own "
    "forward (the reference class in the source's module layout, loaded from the keys as stored, "
    "rounded to the written dtype) on the same tokens, so the key mapping preserves the function"
)


@dataclass
class SourceForward:
    """The source checkpoint's own model, or (``model`` None) why none could be built.

    ``model`` maps ids [B, T] to logits [B, T, V] like ``reference_model``'s result;
    ``description`` says what it was rebuilt as, or why it was not.
    """

    model: object | None
    description: str


def reference_class(config):
    """The reference model class for ``config``'s architecture."""
    return registry.of(config).reference_class()


def reference_model(config: ModelConfig, weights: dict[str, np.ndarray], dtype=None):
    """The reference model of ``config``'s architecture holding ``weights`` (float64 by default)."""
    import torch

    dtype = dtype or torch.float64
    with torch.device("meta"):
        model = reference_class(config)(config)
    state = {k: torch.from_numpy(np.asarray(v, dtype=np.float64)).to(dtype) for k, v in weights.items()}
    model.load_state_dict(state, assign=True)
    return model.eval()


def compute_parity(config: ModelConfig, weights: dict[str, np.ndarray], tokens: int | None = None,
                   batch: int = 2, seed: int = 0, source: SourceForward | None = None) -> dict:
    """The certificate for ``weights``; with ``source``, also the source-forward comparison
    (``source_forward``: a dict, or null with ``source_forward_reason``)."""
    import torch

    check_parity_tokens(tokens, "tokens")
    model = reference_model(config, weights)
    length = min(config.context_length, DEFAULT_TOKENS if tokens is None else tokens)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch, length), generator=generator)
    arch = registry.of(config)
    forms = arch.parity_forms
    with torch.no_grad():
        logits = {form: arch.reference_logits(model, ids, form) for form in forms}
    scale = max(1.0, float(logits[forms[0]].abs().max()))
    pairs = [(a, b) for i, a in enumerate(forms) for b in forms[i + 1:]]
    deltas = {f"{a}_vs_{b}": float((logits[a] - logits[b]).abs().max()) for a, b in pairs}
    tolerance = RELATIVE_TOLERANCE * scale
    certificate = {
        "proves": PROVES_INTERNAL.format(forms=", ".join(forms)),
        "tokens": length,
        "batch": batch,
        "seed": seed,
        "precision": "float64",
        "max_abs_logit": scale,
        "max_abs_delta": deltas,
        "tolerance": tolerance,
        "passed": all(d <= tolerance for d in deltas.values()),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if source is not None:
        certificate |= _source_forward(source, arch, ids, forms[0], logits[forms[0]], tolerance)
        if certificate["source_forward"] is not None:
            certificate["proves"] += PROVES_SOURCE
            certificate["passed"] = certificate["passed"] and certificate["source_forward"]["passed"]
    return certificate


def _source_forward(source: SourceForward, arch, ids, form: str, converted, tolerance: float) -> dict:
    """Run the source's own model in ``form`` on ``ids`` against the converted model's logits."""
    import torch

    if source.model is None:
        return {"source_forward": None, "source_forward_reason": source.description}
    with torch.no_grad():
        delta = float((arch.reference_logits(source.model, ids, form) - converted).abs().max())
    return {"source_forward": {"model": source.description, "form": form, "max_abs_delta": delta,
                               "tolerance": tolerance, "passed": delta <= tolerance}}


def check_parity_tokens(tokens, name: str, error: type[SRMError] = CheckpointError) -> None:
    """``error`` naming ``name`` unless ``tokens`` is None (the default) or a positive integer."""
    if tokens is not None and not (is_int(tokens) and tokens >= 1):
        raise error(f"{name} {tokens!r}: expected a positive integer (tokens per sequence in the parity check)")


def read_certificate(path: str | Path) -> dict:
    """The certificate in ``path``, its run settings (tokens, batch, seed) checked, so that
    recomputing it fails only on the weights."""
    path = Path(path)
    check_regular_file(path)
    try:
        certificate = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: parity certificate not found") from None
    except OSError as e:  # no permission to read it, an I/O error
        raise CheckpointError(f"{path}: corrupt parity certificate (cannot read it: {e.strerror or e})") from None
    except (ValueError, RecursionError) as e:  # ValueError covers JSONDecodeError and Unicode
        raise CheckpointError(f"{path}: corrupt parity certificate ({e})") from None
    if not isinstance(certificate, dict):
        raise CheckpointError(f"{path}: corrupt parity certificate (a JSON {type(certificate).__name__}, "
                              "expected an object)")
    settings = {"tokens": (1, None), "batch": (1, MAX_BATCH), "seed": (0, 2**63 - 1)}
    for name, (low, high) in settings.items():
        value = certificate.get(name, low)
        if not is_plain_int(value) or value < low or (high is not None and value > high):
            bounds = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
            raise CheckpointError(f"{path}: corrupt parity certificate ({name} {value!r}, expected {bounds})")
    return certificate
