"""The parity certificate: the reference's three mixer forms agree on these weights.

Runs the naive (dense n x n), parallel (scan) and recurrent (step by step)
forms of the PyTorch reference on random tokens, in float64, from the weights
as they were written, and records the largest |logit difference| of each pair.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import numpy as np

from .config import SRMConfig
from .errors import CheckpointError

PAIRS = (("naive", "parallel"), ("naive", "recurrent"), ("parallel", "recurrent"))
# float64 work, so disagreement beyond rounding means a broken model or mixer.
RELATIVE_TOLERANCE = 1e-9


def reference_model(config: SRMConfig, weights: dict[str, np.ndarray], dtype=None):
    """A reference SRM holding ``weights`` (float64 by default)."""
    import torch

    from .reference.srm import SRM

    dtype = dtype or torch.float64
    with torch.device("meta"):
        model = SRM(config)
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
    with torch.no_grad():
        logits = {form: model(ids, mixer=form) for form in ("naive", "parallel", "recurrent")}
    scale = max(1.0, float(logits["naive"].abs().max()))
    deltas = {f"{a}_vs_{b}": float((logits[a] - logits[b]).abs().max()) for a, b in PAIRS}
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


def read_certificate(path: str | Path) -> dict:
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: parity certificate not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt parity certificate ({e})") from None
