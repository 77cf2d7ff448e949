"""The SRM token mixer in its three forms, side by side.

All heads of a layer at once. Shapes:
    u      [B, T, H, hd]   projected head inputs
    w      [H, n]          per-position mixer weights (``mixer_heads.{h}.weight``)
    beta   [H, n]          per-position biases (``mixer_heads.{h}.bias``)
    lam    [H]             per-step decay, clip(decay_value, 0.9, 1) ** (1 / c)
    state  [B, H, hd]      column heads: s_t;  row heads: r_t
Heads ``0 .. H/2-1`` are column-repeat, ``H/2 .. H-1`` row-repeat.

    column:  s_t = u_t + lam s_{t-1};          y_t = w[t] s_t + beta[t]
    row:     r_t = w[t] u_t + lam r_{t-1};     y_t = r_t + beta[t]

Every form returns ``(y, final_state)``; ``naive_mixer`` is the oracle.
"""

from __future__ import annotations

import torch

CHUNK = 64  # lam >= 0.9, so lam**63 >= 1e-3: no under- or overflow inside a chunk


def _column_mask(n_heads: int, like: torch.Tensor) -> torch.Tensor:
    """[H] bool: True for column-repeat heads."""
    return torch.arange(n_heads, device=like.device) < n_heads // 2


def _final_state(states: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """Pick each sample's state after its last real token ([B, H, hd]; zeros if empty)."""
    B, T = states.shape[:2]
    if lengths is None:
        return states[:, -1] if T else states.new_zeros(B, *states.shape[2:])
    index = (lengths - 1).clamp(min=0).view(B, 1, 1, 1).expand(B, 1, *states.shape[2:])
    picked = states.gather(1, index).squeeze(1)
    return torch.where((lengths > 0).view(B, 1, 1), picked, torch.zeros_like(picked))


def naive_mixer(u, w, beta, lam, lengths=None):
    """The dense n x n row-/column-repeat matrices exactly as the paper defines them.

    column: M[i, j] = w[j] lam**(j-i)  (j >= i);   row: M[i, j] = w[i] lam**(j-i)
    Y = U^T M + beta.  O(T^2) per channel: for tests only.
    """
    B, T, H, hd = u.shape
    i = torch.arange(T, device=u.device).view(T, 1)
    j = torch.arange(T, device=u.device).view(1, T)
    causal = j >= i
    decay = torch.where(causal, lam.view(H, 1, 1) ** (j - i).clamp(min=0), u.new_zeros(()))
    wt = w[:, :T]
    column = decay * wt.view(H, 1, T)  # w[j]
    row = decay * wt.view(H, T, 1)  # w[i]
    M = torch.where(_column_mask(H, u).view(H, 1, 1), column, row)  # [H, T(i), T(j)]
    y = torch.einsum("bihd,hij->bjhd", u, M) + beta[:, :T].T.view(1, T, H, 1)
    # The state after position j is the same sum without the output weight w[j].
    weighted_u = torch.where(_column_mask(H, u).view(1, 1, H, 1), u, u * wt.T.view(1, T, H, 1))
    states = torch.einsum("bihd,hij->bjhd", weighted_u, decay)
    return y, _final_state(states, lengths)


def parallel_mixer(u, w, beta, lam, lengths=None, chunk: int = CHUNK):
    """O(T) per channel: a chunked scan.

    Inside a chunk the decay matrix is dense (exponents < chunk, so stable);
    the state is carried between chunks. The tempting lam**t * cumsum(lam**-i u_i)
    overflows float32 for long sequences.
    """
    B, T, H, hd = u.shape
    is_column = _column_mask(H, u).view(1, 1, H, 1)
    wt = w[:, :T].T.reshape(1, T, H, 1)
    v = torch.where(is_column, u, wt * u)  # what enters the state at each step
    chunks = []
    carry = v.new_zeros(B, H, hd)
    for start in range(0, T, chunk):
        stop = min(start + chunk, T)
        C = stop - start
        k = torch.arange(C, device=u.device)
        gap = (k.view(C, 1) - k.view(1, C)).to(u.dtype)  # j - i
        within = torch.where(gap >= 0, lam.view(H, 1, 1) ** gap.clamp(min=0), u.new_zeros(()))
        local = torch.einsum("hji,bihd->bjhd", within, v[:, start:stop])
        carried = lam.view(1, 1, H, 1) ** (k + 1).to(u.dtype).view(1, C, 1, 1) * carry.unsqueeze(1)
        chunks.append(local + carried)  # a list, not in-place writes: autograd trains through it
        carry = chunks[-1][:, -1]
    states = torch.cat(chunks, 1) if chunks else v.new_zeros(B, 0, H, hd)
    y = torch.where(is_column, wt * states, states) + beta[:, :T].T.reshape(1, T, H, 1)
    return y, _final_state(states, lengths)


def recurrent_mixer_step(u, positions, state, w, beta, lam):
    """One decode step for a batch with per-sample positions.

    u [B, H, hd], positions [B] (absolute, 0-based), state [B, H, hd].
    Returns (y [B, H, hd], new_state).
    """
    B, H, hd = u.shape
    is_column = _column_mask(H, u).view(1, H, 1)
    wt = w[:, positions].T.reshape(B, H, 1)  # gather w[h, t_b]
    bt = beta[:, positions].T.reshape(B, H, 1)
    lam = lam.view(1, H, 1)
    new_state = torch.where(is_column, u, wt * u) + lam * state
    y = torch.where(is_column, wt * new_state, new_state) + bt
    return y, new_state


def recurrent_mixer(u, w, beta, lam, lengths=None):
    """The whole sequence through ``recurrent_mixer_step``: same signature as the others."""
    B, T, H, hd = u.shape
    state = u.new_zeros(B, H, hd)
    ys, states = [], []
    for t in range(T):
        positions = torch.full((B,), t, dtype=torch.long, device=u.device)
        y, state = recurrent_mixer_step(u[:, t], positions, state, w, beta, lam)
        ys.append(y)
        states.append(state)
    y = torch.stack(ys, 1) if ys else u.clone()
    all_states = torch.stack(states, 1) if states else u.new_zeros(B, 0, H, hd)
    return y, _final_state(all_states, lengths)


MIXERS = {"naive": naive_mixer, "parallel": parallel_mixer, "recurrent": recurrent_mixer}
