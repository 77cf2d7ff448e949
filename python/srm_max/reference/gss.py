"""The GSS branch (Gated State Spaces) and its DSS kernel, in two forms side by side.

    u = gelu(W_u x)                 # E -> F
    v = gelu(W_v x + b_v)           # E -> H
    y = DSS(v)                      # sequence mixing, H channels
    o = W_o ((W_g y) * u) + b_o

DSS (diagonal state space, dt = 1), N complex states shared over the H channels:

    Lambda = -exp(Lambda_real) + i exp(Lambda_imag)        [N]
    Abar   = exp(Lambda);   Ct = C (exp(Lambda) - 1) / Lambda    [H, N]
    s_t    = Abar s_{t-1} + LN(v)_t          (complex, [B, H, N])
    y_t    = Re(Ct . s_t) + D LN(v)_t

``fft_dss`` runs it as a causal convolution with K[l, h] = Re(sum_n Ct Abar**l)
(FFT, zero-padded to 2T so nothing wraps); ``recurrent_dss`` one step at a time.
Both take ``initial_state`` [B, H, N] and return ``(y, final_state)``. The state
and the kernel are complex64 (complex128 for float64 inputs) whatever the model's
dtype: a half-precision state loses the slow modes.

Parameter names follow lucidrains/gated-state-spaces-pytorch (``to_u``, ``to_v``,
``dss.Lambda_real``, ...), without its outer LayerNorm and residual (the PHA block
owns those).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def state_dtypes(dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """(real, complex) dtypes the DSS computes in: float64/complex128 or float32/complex64."""
    return (torch.float64, torch.complex128) if dtype == torch.float64 else (torch.float32, torch.complex64)


def dss_params(Lambda_real, Lambda_imag, C_real, C_imag, real_dtype=torch.float32):
    """(Lambda [N], Ct [H, N]) complex, from the real parameters."""
    Lambda = torch.complex(-Lambda_real.to(real_dtype).exp(), Lambda_imag.to(real_dtype).exp())
    C = torch.complex(C_real.to(real_dtype), C_imag.to(real_dtype))
    return Lambda, C * (Lambda.exp() - 1) / Lambda


def _powers(Lambda: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """Abar ** e = exp(Lambda e), for integer exponents e >= 0: [*e.shape, N]."""
    return torch.exp(Lambda * exponents.to(Lambda.real.dtype).unsqueeze(-1))


def fft_dss(u, Lambda, Ct, D, initial_state=None, lengths=None):
    """Convolution form. u [B, T, H] (already LayerNormed), Lambda [N], Ct [H, N], D [H].

    Returns (y [B, T, H] in u's dtype, state [B, H, N] complex) where the state is
    s after each sample's last real token (``lengths`` [B], default T).
    """
    B, T, H = u.shape
    if T == 0:
        return recurrent_dss(u, Lambda, Ct, D, initial_state, lengths)
    real, cplx = state_dtypes(u.dtype)
    x = u.to(real)
    t = torch.arange(T, device=u.device)
    K = torch.einsum("hn,tn->th", Ct, _powers(Lambda, t)).real  # [T, H]
    y = torch.fft.irfft(torch.fft.rfft(x, n=2 * T, dim=1) * torch.fft.rfft(K, n=2 * T, dim=0), n=2 * T, dim=1)
    y = y[:, :T] + D.to(real) * x
    s0 = initial_state
    if s0 is not None:
        # s_t also holds Abar**(t+1) s0.
        y = y + torch.einsum("hn,tn,bhn->bth", Ct, _powers(Lambda, t + 1), s0.to(cplx)).real

    # s_{e-1} = Abar**e s0 + sum_{j<e} Abar**(e-1-j) u_j, with e = each sample's length.
    ends = torch.full((B,), T, device=u.device) if lengths is None else lengths.to(u.device)
    gap = ends.view(B, 1) - 1 - t.view(1, T)  # [B, T]
    weights = _powers(Lambda, gap.clamp(min=0)) * (gap >= 0).unsqueeze(-1)  # [B, T, N]
    state = torch.einsum("btn,bth->bhn", weights, x.to(cplx))
    if s0 is not None:
        state = state + _powers(Lambda, ends).unsqueeze(1) * s0.to(cplx)
    return y.to(u.dtype), state


def recurrent_dss_step(u, state, Lambda, Ct, D):
    """One step: u [B, H], state [B, H, N] complex -> (y [B, H], new_state)."""
    real, cplx = state_dtypes(u.dtype)
    x = u.to(real)
    state = Lambda.exp() * state.to(cplx) + x.unsqueeze(-1)
    y = (Ct * state).sum(-1).real + D.to(real) * x
    return y.to(u.dtype), state


def recurrent_dss(u, Lambda, Ct, D, initial_state=None, lengths=None):
    """The whole sequence through ``recurrent_dss_step``: same signature as ``fft_dss``."""
    B, T, H = u.shape
    _, cplx = state_dtypes(u.dtype)
    state = u.new_zeros(B, H, Lambda.shape[0], dtype=cplx) if initial_state is None else initial_state.to(cplx)
    final = state.clone()
    ys = []
    for t in range(T):
        y, state = recurrent_dss_step(u[:, t], state, Lambda, Ct, D)
        ys.append(y)
        if lengths is not None:
            final = torch.where((lengths.to(u.device) == t + 1).view(B, 1, 1), state, final)
    y = torch.stack(ys, 1) if ys else u.clone()
    return y, (state if lengths is None else final)


DSS_FORMS = {"fft": fft_dss, "recurrent": recurrent_dss}


class DSS(nn.Module):
    """Inner LayerNorm, then the diagonal state space over H channels."""

    def __init__(self, hidden_dim: int, state_size: int, eps: float = 1e-5):
        super().__init__()
        H, N = hidden_dim, state_size
        self.norm = nn.LayerNorm(H, eps=eps)
        # lucidrains' init (randn), except C scaled by N**-0.5 so K's size does not grow with N.
        self.Lambda_real = nn.Parameter(torch.randn(N))
        self.Lambda_imag = nn.Parameter(torch.randn(N))
        self.C_real = nn.Parameter(torch.randn(H, N) * N**-0.5)
        self.C_imag = nn.Parameter(torch.randn(H, N) * N**-0.5)
        self.param_D = nn.Parameter(torch.randn(H))

    def kernel(self, dtype: torch.dtype):
        """(Lambda [N], Ct [H, N]) in the complex dtype for a model running in ``dtype``."""
        return dss_params(self.Lambda_real, self.Lambda_imag, self.C_real, self.C_imag, state_dtypes(dtype)[0])

    def forward(self, v, form: str = "fft", initial_state=None, lengths=None):
        """v [B, T, H] -> (y [B, T, H], state [B, H, N] complex)."""
        return DSS_FORMS[form](self.norm(v), *self.kernel(v.dtype), self.param_D, initial_state, lengths)

    def step(self, v, state):
        """v [B, H] -> (y [B, H], new state)."""
        return recurrent_dss_step(self.norm(v), state, *self.kernel(v.dtype), self.param_D)


class GSS(nn.Module):
    """The gated state space branch: E -> E, with a recurrent state [B, H, N]."""

    def __init__(self, d_model: int, expansion_dim: int, hidden_dim: int, state_size: int, eps: float = 1e-5):
        super().__init__()
        self.to_u = nn.Linear(d_model, expansion_dim, bias=False)
        self.to_v = nn.Linear(d_model, hidden_dim)
        self.dss = DSS(hidden_dim, state_size, eps)
        self.to_gate = nn.Linear(hidden_dim, expansion_dim, bias=False)
        self.to_out = nn.Linear(expansion_dim, d_model)

    def forward(self, x, form: str = "fft", initial_state=None, lengths=None):
        """x [B, T, E] -> (out [B, T, E], state [B, H, N])."""
        u = F.gelu(self.to_u(x))
        y, state = self.dss(F.gelu(self.to_v(x)), form, initial_state, lengths)
        return self.to_out(self.to_gate(y) * u), state

    def step(self, x, state):
        """x [B, E], state [B, H, N] -> (out [B, E], new state)."""
        u = F.gelu(self.to_u(x))
        y, state = self.dss.step(F.gelu(self.to_v(x)), state)
        return self.to_out(self.to_gate(y) * u), state
