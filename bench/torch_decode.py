"""The strongest plain-PyTorch greedy decode of an SRM: the baseline a PyTorch user would
write for speed, beside the readable reference step (``SRM.step``).

The reference step rebuilds every layer's mixer parameters (``mixer_params``: cat,
stack, clamp, pow), runs one Linear per head and selects column/row heads with
``torch.where`` on every call. Here all of that is done once, from the reference model:

    proj          the heads' projections stacked into one [d, d] matrix (head-major rows,
                  the order of the reference's ``y.flatten(-2)`` and of the state [B, H, hd])
    coefficients  per position and channel, all layers side by side, [n, 3, L, d]:
                  a = input multiplier   (1 for column-repeat channels, w[h, t] for row)
                  b = output multiplier  (w[h, t] for column, 1 for row)
                  beta[h, t] expanded to the head's channels
    lam           per channel, each layer's [d]: clip(decay, 0.9, 1) ** (1 / c)

so the mixer update is two elementwise ops per layer, with no per-head loop and no select:

    s = lam * s + a[t] * u          (column: u + lam s;      row: w u + lam s)
    y = beta[t] + b[t] * s          (column: w s + beta;     row: s + beta)

Multiplying by 1 is exact, so eagerly this is the reference's arithmetic but for the
summation order of the matrix products (one [d, d] product instead of H [hd, d] ones);
compiled, inductor also picks its own matrix product kernels and may fuse multiplies
and adds. One gather a step fetches every layer's coefficients at the batch's positions, which
are clamped to n - 1 as srm-max's engine does. The step (embedding, every layer, logits,
argmax) is one module, run eagerly or through ``torch.compile``; the recurrent state
[L, B, d] is updated in place.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def _frozen(t: torch.Tensor) -> nn.Parameter:
    # Parameters, not plain tensors: torch.compile's freezing folds parameters into the
    # compiled graph as constants (and may repack the matrices for its GEMMs).
    return nn.Parameter(t.detach().float().contiguous(), requires_grad=False)


def _mixer_coefficients(token_mixer, column: torch.Tensor, head_dim: int):
    """-> (lam [d], [n, 3, d]: the input multiplier a, the output multiplier b, beta)."""
    w, beta, lam = token_mixer.mixer_params()  # [H, n], [H, n], [H]
    w_c = w.T.repeat_interleave(head_dim, dim=1)  # [n, d]
    one = torch.ones_like(w_c)
    return lam.repeat_interleave(head_dim), torch.stack(
        [torch.where(column, one, w_c), torch.where(column, w_c, one), beta.T.repeat_interleave(head_dim, dim=1)], 1)


class _FusedLayer(nn.Module):
    """One block: the channel MLP, then the token mixer with its heads stacked."""

    def __init__(self, block, lam: torch.Tensor):
        super().__init__()
        tm = block.token_mixing_layer
        fc1, fc2 = block.channel_mixing_layer[0], block.channel_mixing_layer[2]
        self.eps = block.channel_norm.eps
        self.cn_w, self.cn_b = _frozen(block.channel_norm.weight), _frozen(block.channel_norm.bias)
        self.fc1_w, self.fc1_b = _frozen(fc1.weight), _frozen(fc1.bias)
        self.fc2_w, self.fc2_b = _frozen(fc2.weight), _frozen(fc2.bias)
        self.tn_w, self.tn_b = _frozen(block.token_norm.weight), _frozen(block.token_norm.bias)
        self.proj_w = _frozen(torch.cat([p.weight for p in tm.proj_head]))  # [d, d], head-major rows
        self.proj_b = _frozen(torch.cat([p.bias for p in tm.proj_head]))
        self.out_w, self.out_b = _frozen(tm.out_proj.weight), _frozen(tm.out_proj.bias)
        self.lam = _frozen(lam)  # [d]

    def forward(self, x: torch.Tensor, state: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
        """x [B, d], state [B, d] (updated in place), coef [B, 3, d] -> x [B, d]."""
        d = x.shape[-1]
        h = F.linear(F.layer_norm(x, (d,), self.cn_w, self.cn_b, self.eps), self.fc1_w, self.fc1_b)
        x = x + F.linear(F.silu(h, inplace=True), self.fc2_w, self.fc2_b)
        u = F.linear(F.layer_norm(x, (d,), self.tn_w, self.tn_b, self.eps), self.proj_w, self.proj_b)
        state.mul_(self.lam).addcmul_(coef[:, 0], u)
        return x + F.linear(torch.addcmul(coef[:, 2], coef[:, 1], state), self.out_w, self.out_b)


class FusedSRMStep(nn.Module):
    """A reference SRM's weights laid out for one greedy step (see the module docstring);
    ``forward`` is the step: ids [B], positions [B], states [L, B, d] -> next ids [B]."""

    def __init__(self, model):
        super().__init__()
        c = model.config
        self.config = c
        column = torch.arange(c.d_model) < c.d_model // 2  # heads 0 .. H/2-1 are column-repeat
        with torch.no_grad():
            self.embedding = _frozen(model.input_layer.weight)
            self.head = _frozen(model.output_layer.weight)
            mixers = [_mixer_coefficients(b.token_mixing_layer, column, c.head_dim) for b in model.mixer_blocks]
            self.layers = nn.ModuleList(_FusedLayer(b, lam) for b, (lam, _) in zip(model.mixer_blocks, mixers))
            # every layer's coefficients side by side: one gather a step fetches them all
            self.coefficients = _frozen(torch.stack([coef for _, coef in mixers], 2))  # [n, 3, L, d]
        self.last_position = c.context_length - 1

    def empty_state(self, batch: int) -> torch.Tensor:
        c = self.config
        return torch.zeros(c.n_layers, batch, c.d_model)

    def logits(self, ids: torch.Tensor, positions: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """One step: ids [B] at positions [B] -> logits [B, V]; states [L, B, d] updated in place."""
        coef = self.coefficients[positions.clamp(max=self.last_position)]  # [B, 3, L, d]
        x = F.embedding(ids, self.embedding)
        for l, layer in enumerate(self.layers):
            x = layer(x, states[l], coef[:, :, l])
        return F.linear(x, self.head)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """One greedy step: the next ids [B] (the first argmax, as the reference's)."""
        return self.logits(ids, positions, states).argmax(-1)


class TorchFusedDecode:
    """``FusedSRMStep``'s greedy decode, ``steps`` steps per ``run`` from zero states at
    ``threads``; with ``compile`` the step goes through ``torch.compile`` (compiled, and
    warmed up, in ``prepare``: the timed runs hold no compilation) in ``mode``, with
    inductor's freezing: PyTorch's recipe for CPU inference. Frozen weights and
    "max-autotune-no-cudagraphs" let inductor time its C++ GEMM template on prepacked weights
    against the BLAS for each product and keep the faster; without freezing (weights as
    graph inputs) or in the default mode every product calls the BLAS, as eager does. The
    same interface as cpu_decode.py's engines."""

    def __init__(self, model, threads: int, compile: bool = False, start_position: int = 100,
                 mode: str | None = "max-autotune-no-cudagraphs"):
        self.fused = FusedSRMStep(model)
        self.threads, self.compile, self.mode = threads, compile, mode
        self.start_position = start_position
        self.step = self.fused

    def prepare(self, batch: int, steps: int):
        torch.set_num_threads(self.threads)
        vocab = self.fused.config.vocab_size
        self.ids = torch.arange(batch, dtype=torch.int64) * 7 % vocab
        self.pos = torch.full((batch,), self.start_position, dtype=torch.int64)
        self.states = self.fused.empty_state(batch)
        self.steps = steps
        if self.compile:
            # Shapes are fixed per batch: one static graph per batch (and per instance:
            # dynamo keys its cache on the step's code, shared by all instances), so a run
            # over many batches must not hit dynamo's default limit of 8 graphs.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self.step = torch.compile(self.fused, mode=self.mode, dynamic=False, fullgraph=True)
            # Compiles on the first call, with freezing on while dynamo traces (not only in
            # inductor): the parameters become constants of the graph, so inductor may
            # prepack them for its own GEMMs, and are guarded by identity, so no other
            # instance (another thread count) reuses this instance's graph. Autotuning's
            # reports on stderr (and a deprecation warning inside inductor) would bury the
            # benchmark's own output.
            quiet = dict(autotune_num_choices_displayed=0, max_autotune_report_choices_stats=False)
            with torch._inductor.config.patch(freezing=True, **quiet), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
                self.run()
        self.run()

    def run(self) -> np.ndarray:
        torch.set_num_threads(self.threads)
        ids, pos, states = self.ids, self.pos, self.states
        out = torch.empty(ids.shape[0], self.steps, dtype=torch.int64)
        with torch.inference_mode():
            states.zero_()  # every run decodes from the same (zero) states
            for i in range(self.steps):
                ids = self.step(ids, pos + i, states)
                out[:, i] = ids
        return out.numpy()
