"""The PHA weight schema: every checkpoint key with its shape.

Keys follow ``reference/pha.py`` (the GSS names are lucidrains'); the tensors the
graphs derive from them at load time are in ``graphs/pha``.
"""

from __future__ import annotations


def checkpoint_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every parameter of a PHA model (``reference/pha.py``) by key, with its shape.

    embed.weight                               [V, E]
    lm_head.weight                             [V, E]      only if not tie_embeddings
    blocks.{l}.branches.gss.to_u.weight        [F, E]      (names as lucidrains' GSS)
    blocks.{l}.branches.gss.to_v.weight / bias [H, E] / [H]
    blocks.{l}.branches.gss.dss.norm.weight / bias   [H]  (inner LayerNorm)
    blocks.{l}.branches.gss.dss.Lambda_real / Lambda_imag  [N]
    blocks.{l}.branches.gss.dss.C_real / C_imag      [H, N]
    blocks.{l}.branches.gss.dss.param_D              [H]
    blocks.{l}.branches.gss.to_gate.weight     [F, H]
    blocks.{l}.branches.gss.to_out.weight / bias [E, F] / [E]
    blocks.{l}.branches.attn.{q,o}_proj.weight [Hq*dh, E] / [E, Hq*dh]
    blocks.{l}.branches.attn.{k,v}_proj.weight [Hkv*dh, E]
    blocks.{l}.branches.attn.logit_scale       [Hq]
    blocks.{l}.branches.ffn_{i}.fc.weight / bias   [Fi, E] / [Fi]
    blocks.{l}.branches.ffn_{i}.proj.weight / bias [E, Fi] / [E]
    blocks.{l}.branch_norms.{branch}.weight    [E]         RMSNorm per branch
    parallel:   blocks.{l}.mixing [n_branches];  blocks.{l}.post_norm.weight / bias [E]
    sequential: blocks.{l}.post_norms.{branch}.weight / bias [E]
    """
    E, V = config.d_model, config.vocab_size
    F, H, N = config.gss_expansion_dim, config.gss_hidden_dim, config.dss_state_size
    dh = config.head_dim
    shapes = {"embed.weight": (V, E)}
    for l in range(config.n_layers):
        p = f"blocks.{l}."
        b = p + "branches."
        if "gss" in config.branches:
            shapes |= {
                b + "gss.to_u.weight": (F, E),
                b + "gss.to_v.weight": (H, E),
                b + "gss.to_v.bias": (H,),
                b + "gss.dss.norm.weight": (H,),
                b + "gss.dss.norm.bias": (H,),
                b + "gss.dss.Lambda_real": (N,),
                b + "gss.dss.Lambda_imag": (N,),
                b + "gss.dss.C_real": (H, N),
                b + "gss.dss.C_imag": (H, N),
                b + "gss.dss.param_D": (H,),
                b + "gss.to_gate.weight": (F, H),
                b + "gss.to_out.weight": (E, F),
                b + "gss.to_out.bias": (E,),
            }
        if "attn" in config.branches:
            shapes |= {
                b + "attn.q_proj.weight": (config.n_q_heads * dh, E),
                b + "attn.k_proj.weight": (config.n_kv_heads * dh, E),
                b + "attn.v_proj.weight": (config.n_kv_heads * dh, E),
                b + "attn.o_proj.weight": (E, config.n_q_heads * dh),
                b + "attn.logit_scale": (config.n_q_heads,),
            }
        for i, f in enumerate(config.ffn_dims):
            shapes |= {
                b + f"ffn_{i}.fc.weight": (f, E),
                b + f"ffn_{i}.fc.bias": (f,),
                b + f"ffn_{i}.proj.weight": (E, f),
                b + f"ffn_{i}.proj.bias": (E,),
            }
        for name in config.branch_names:
            shapes[p + f"branch_norms.{name}.weight"] = (E,)
        if config.mode == "parallel":
            shapes |= {p + "mixing": (config.n_branches,), p + "post_norm.weight": (E,), p + "post_norm.bias": (E,)}
        else:
            for name in config.branch_names:
                shapes |= {p + f"post_norms.{name}.weight": (E,), p + f"post_norms.{name}.bias": (E,)}
    if not config.tie_embeddings:
        shapes["lm_head.weight"] = (V, E)
    return shapes


__all__ = ["checkpoint_shapes"]
