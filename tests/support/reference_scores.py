"""Log-probabilities the torch reference gives, computed by the rules the scoring API and
lm-eval follow."""

from __future__ import annotations

import numpy as np
import torch

from tests.support.tiny import TINY


def ref_log_softmax(model, ids) -> np.ndarray:
    """[T, V]: the reference's log-probabilities after each prefix of ``ids``."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids]))[0].float(), -1).numpy()


def ref_windows(model, windows) -> np.ndarray:
    """The reference's log-probabilities of each (context, targets) window's targets, concatenated."""
    out = []
    for ctx, tgt in windows:
        lp = ref_log_softmax(model, (ctx + tgt)[:-1])
        out.append(lp[np.arange(len(ctx) - 1, len(ctx) + len(tgt) - 1), tgt])
    return np.concatenate(out) if out else np.zeros(0)


def lm_eval_loglikelihood(model, ctx, cont, n=TINY.context_length):
    """lm-eval's HF ``_loglikelihood_tokens`` on the reference: the last n + 1 tokens,
    the continuation's log-probabilities summed, greedy if each is the argmax."""
    whole = (ctx + cont)[-(n + 1):]
    lp = ref_log_softmax(model, whole[:-1])[-len(cont):]
    return float(lp[np.arange(len(cont)), cont].sum()), bool((lp.argmax(-1) == cont).all())

