"""``srm-max verify PATH``: re-check a model directory end to end.

1. integrity: the checkpoint loads (every key, shape, dtype, finite values) and
   the weights' sha256 equals the one its parity certificate recorded;
2. tokenizer: its tokenizer.json, if it has one, loads as ``generate`` and
   ``serve`` load it, and produces no id outside the model's vocabulary;
3. parity: the certificate is recomputed (naive, parallel and recurrent forms
   of the reference on the same random tokens) and must pass again;
4. engine: MAX greedy decoding equals the PyTorch reference on a few prompts,
   and the MAX prefill logits are within tolerance of the reference.
Each check reports what it found; any failure makes the command exit 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .format import PARITY_FILE, WEIGHTS_FILE, load_checkpoint
from .convert import file_sha256
from ..errors import CheckpointError, SRMError
from .parity import compute_parity, read_certificate, reference_model
from .tokenizer import check_vocabulary, largest_id, read_tokenizer

LOGIT_RTOL = 1e-3  # MAX float32 against the float64 reference, relative to the logit scale


@dataclass
class Check:
    name: str
    passed: bool
    detail: str


def verify(path: str | Path, prompts: int = 3, new_tokens: int = 16, engine: bool = True) -> list[Check]:
    path = Path(path)
    checks: list[Check] = []
    try:
        ckpt = load_checkpoint(path)
    except SRMError as e:
        return [Check("integrity", False, str(e))]
    try:
        certificate = read_certificate(path / PARITY_FILE)
    except SRMError as e:
        return [Check("integrity", False, str(e))]
    recorded = certificate.get("weights_sha256")
    actual = file_sha256(path / WEIGHTS_FILE)
    checks.append(Check("integrity", recorded == actual,
                        f"{WEIGHTS_FILE} sha256 {actual[:16]}... "
                        + ("matches the certificate" if recorded == actual else f"!= certified {str(recorded)[:16]}...")))
    checks.append(_tokenizer_check(ckpt))

    again = compute_parity(ckpt.config, ckpt.weights, tokens=certificate.get("tokens"),
                           batch=certificate.get("batch", 2), seed=certificate.get("seed", 0))
    worst = max(again["max_abs_delta"].values())
    checks.append(Check("parity", again["passed"], f"max |delta logit| {worst:.3g} (tolerance {again['tolerance']:.3g})"))

    if engine:
        checks.append(_engine_check(ckpt, prompts, new_tokens))
    return checks


def _tokenizer_check(ckpt) -> Check:
    """The checkpoint's tokenizer.json read and held to the vocabulary as the loaders do."""
    if ckpt.tokenizer_path is None:
        return Check("tokenizer", True, "none (the model takes token ids)")
    try:
        tokenizer = read_tokenizer(ckpt.tokenizer_path, CheckpointError)
        check_vocabulary(tokenizer, ckpt.config.vocab_size, CheckpointError, str(ckpt.tokenizer_path))
    except CheckpointError as e:
        return Check("tokenizer", False, str(e))
    return Check("tokenizer", True, f"{tokenizer.get_vocab_size()} tokens, ids up to {largest_id(tokenizer)} "
                                    f"within the vocabulary of {ckpt.config.vocab_size}")


def _engine_check(ckpt, prompts: int, new_tokens: int) -> Check:
    import torch

    from ..models import registry
    from ..runtime.call_types import SamplingArrays

    config = ckpt.config
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(1, max(2, config.context_length // 4), prompts)]
    new_tokens = min(new_tokens, config.context_length - max(lengths))
    prompt_ids = [rng.integers(0, config.vocab_size, n).tolist() for n in lengths]

    engine = registry.of(config).engine(config, ckpt.weights, dtype="float32", device="cpu")
    model = reference_model(config, ckpt.weights)
    mismatches, worst = 0, 0.0
    with torch.no_grad():
        for ids in prompt_ids:
            expected = model.generate_greedy(torch.tensor(ids), new_tokens).tolist()
            prefilled = engine.prefill([ids])
            got = [int(prefilled.next_ids[0])]
            if new_tokens > 1:  # the engine's own greedy steps, as every decode runs them
                decoded = engine.decode([got[0]], [len(ids)], prefilled.states, SamplingArrays.greedy(1),
                                        steps=new_tokens - 1)
                got += decoded.tokens[0].tolist()
            mismatches += expected != got[:new_tokens]
            expected_logits = model(torch.tensor([ids]))[0, -1].numpy()
            max_logits = engine.host(prefilled.logits)[0]
            scale = max(1.0, float(np.abs(expected_logits).max()))
            worst = max(worst, float(np.abs(max_logits - expected_logits).max()) / scale)
    passed = mismatches == 0 and worst <= LOGIT_RTOL
    return Check("engine", passed, f"MAX greedy == reference on {prompts - mismatches}/{prompts} prompts "
                                   f"x {new_tokens} tokens; prefill logits rel. error {worst:.2g}")
