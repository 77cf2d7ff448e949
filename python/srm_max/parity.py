"""The parity certificate: the reference's forms agree on these weights.

SRM: the naive (dense n x n), parallel (scan) and recurrent (step by step)
token-mixer forms. PHA: the GSS branch as FFT convolution and as recurrence,
and prefill + step-by-step decode with the KV cache. All run on random
tokens, in float64, from the weights as they were written; the certificate
records the largest |logit difference| of each pair.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import numpy as np

from .config import SRMConfig
from .errors import CheckpointError

FORMS = {"srm": ("naive", "parallel", "recurrent"), "pha": ("fft", "recurrent", "decode")}
# float64 work, so disagreement beyond rounding means a broken model or mixer.
RELATIVE_TOLERANCE = 1e-9


def reference_model(config: SRMConfig, weights: dict[str, np.ndarray], dtype=None):
    """A reference SRM holding ``weights`` (float64 by default)."""
    import torch

    if config.architecture == "pha":
        from .reference.pha import PHA as Model
    else:
        from .reference.srm import SRM as Model

    dtype = dtype or torch.float64
    with torch.device("meta"):
        model = Model(config)
    state = {k: torch.from_numpy(np.asarray(v, dtype=np.float64)).to(dtype) for k, v in weights.items()}
    model.load_state_dict(state, assign=True)
    return model.eval()


def compute_parity(config: SRMConfig, weights: dict[str, np.ndarray], tokens: int | None = None,
                   batch: int = 2, seed: int = 0) -> dict:
    import torch

    model = reference_model(config, weights)
    length = min(config.context_length, tokens or 256)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch, length), generator=generator)
    forms = FORMS[config.architecture]
    with torch.no_grad():
        logits = {form: _logits(model, ids, form) for form in forms}
    scale = max(1.0, float(logits[forms[0]].abs().max()))
    pairs = [(a, b) for i, a in enumerate(forms) for b in forms[i + 1:]]
    deltas = {f"{a}_vs_{b}": float((logits[a] - logits[b]).abs().max()) for a, b in pairs}
    return {
        "tokens": length,
        "batch": batch,
        "seed": seed,
        "precision": "float64",
        "max_abs_logit": scale,
        "max_abs_delta": deltas,
        "tolerance": RELATIVE_TOLERANCE * scale,
        "passed": all(d <= RELATIVE_TOLERANCE * scale for d in deltas.values()),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def _logits(model, ids, form: str):
    import torch

    if form == "decode":  # PHA: the first token by prefill, then one step at a time
        logits, cache = model.prefill(ids[:, :1])
        out = [logits[:, 0]]
        for t in range(1, ids.shape[1]):
            step_logits, cache = model.step(ids[:, t], torch.full((ids.shape[0],), t), cache)
            out.append(step_logits)
        return torch.stack(out, 1)
    if form in ("fft", "recurrent") and model.config.architecture == "pha":
        return model(ids, gss_form=form)
    return model(ids, mixer=form)


def read_certificate(path: str | Path) -> dict:
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: parity certificate not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt parity certificate ({e})") from None
