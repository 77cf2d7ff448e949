"""The models the trainer builds, by ``--arch``: the reference SRM, the PHA hybrid and the
Transformer baseline (PyTorch, from ``srm_max.reference``).

Each architecture has two builders: its config from the parsed arguments and the
vocabulary size (cheap, so that sizes that do not fit are refused before any
work), and its model from that config. The config is saved as ``config.json``
beside the trained weights. Another architecture is two more builders and one
more line in ``ARCHITECTURES``.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import NamedTuple

from torch import nn

from ..errors import CheckpointError
from ..models.pha.arch import PHA_ARCH
from ..models.pha.config import PHAConfig
from ..models.srm.arch import SRM_ARCH
from ..models.srm.config import SRMConfig
from ..reference.pha import PHA
from ..reference.srm import SRM
from ..reference.transformer import Transformer, TransformerConfig, matched_config
from .errors import TrainError


def srm_config_from_args(args: argparse.Namespace, vocab_size: int) -> SRMConfig:
    return SRMConfig(vocab_size=vocab_size, d_model=args.d_model, n_layers=args.n_layers,
                     n_heads=args.n_heads, context_length=args.context_length,
                     ffn_expansion=args.ffn_expansion, decay=not args.no_decay)


def _int_list(text: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise TrainError(f"{option} must be comma-separated integers, got {text!r}") from None


def _name_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def pha_config_from_args(args: argparse.Namespace, vocab_size: int) -> PHAConfig:
    """The PHAConfig of ``--arch pha``: sizes from the shared flags, every PHA choice
    not given on the command line left at its ``PHAConfig`` default."""
    given = {
        "gss_expansion_dim": args.gss_expansion_dim or None,
        "gss_hidden_dim": args.gss_hidden_dim or None,
        "dss_state_size": args.dss_state_size or None,
        "ffn_dims": _int_list(args.pha_ffn_dims, "--pha-ffn-dims") if args.pha_ffn_dims is not None else None,
        "branches": _name_list(args.pha_branches) if args.pha_branches else None,
        "mode": args.pha_mode,
    }
    if args.no_deepnorm:
        given["deepnorm"] = False
    if args.untie_embeddings:
        given["tie_embeddings"] = False
    return PHAConfig(vocab_size=vocab_size, d_model=args.d_model, n_layers=args.n_layers,
                     context_length=args.context_length, n_q_heads=args.n_heads,
                     n_kv_heads=args.n_kv_heads or args.n_heads,
                     **{k: v for k, v in given.items() if v is not None})


def transformer_config_from_args(args: argparse.Namespace, vocab_size: int) -> TransformerConfig:
    srm_cfg = srm_config_from_args(args, vocab_size)  # the sizes are checked as the SRM's
    if args.ffn_dim:
        return TransformerConfig(vocab_size, args.d_model, args.n_layers, args.n_heads,
                                 args.context_length, args.ffn_dim)
    return matched_config(srm_cfg)  # same parameter count as the SRM of these sizes


def build_srm(args: argparse.Namespace, cfg: SRMConfig) -> nn.Module:
    model = SRM(cfg)
    if args.srm_mixer != "parallel":
        # Same function, another form of the token mixer; the weights do not change.
        model.forward = functools.partial(model.forward, mixer=args.srm_mixer)
    return model


def build_pha(args: argparse.Namespace, cfg: PHAConfig) -> nn.Module:
    return PHA(cfg)


def build_transformer(args: argparse.Namespace, cfg: TransformerConfig) -> nn.Module:
    return Transformer(cfg)


class Builders(NamedTuple):
    """How the trainer builds one architecture: its config, then its model."""

    config: Callable[[argparse.Namespace, int], object]  # (args, vocab_size) -> config
    model: Callable[[argparse.Namespace, object], nn.Module]  # (args, config) -> model


# The served architectures by their registry names, and the Transformer baseline (trained for
# comparisons, never served).
ARCHITECTURES: dict[str, Builders] = {
    SRM_ARCH.name: Builders(srm_config_from_args, build_srm),
    PHA_ARCH.name: Builders(pha_config_from_args, build_pha),
    "transformer": Builders(transformer_config_from_args, build_transformer),
}


def model_config(args: argparse.Namespace, vocab_size: int):
    """The config of the architecture ``args.arch``, or ``TrainError`` naming the sizes that
    do not fit it."""
    try:
        return ARCHITECTURES[args.arch].config(args, vocab_size)
    except TrainError:
        raise
    except (CheckpointError, ValueError) as e:  # the configs' own checks (the Transformer's are ValueErrors)
        raise TrainError(f"--arch {args.arch}: {str(e).removeprefix('config: ')}") from None


def build_model(args: argparse.Namespace, config) -> nn.Module:
    """The model of the architecture ``args.arch`` with ``config`` (of ``model_config``)."""
    return ARCHITECTURES[args.arch].model(args, config)
