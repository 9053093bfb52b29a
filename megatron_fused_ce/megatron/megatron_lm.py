"""Megatron-LM (argparse) integration: a `pretrain_gpt.py`-style script gets the fused loss in two lines.

    from megatron_fused_ce.megatron import FusedCEConfig, add_fused_ce_args, install_fused_output_layer

    pretrain(..., extra_args_provider=add_fused_ce_args)                          # 1: the flags
    def model_provider(pre_process=True, post_process=True, vp_stage=None):
        ...
        install_fused_output_layer(model, FusedCEConfig.from_megatron_cfg(vars(get_args())))  # 2
        return model

`forward_step` and `loss_func` stay as they are: `model(tokens, position_ids, attention_mask,
labels=labels, loss_mask=loss_mask)` returns the per-token loss `[b, s]` of the main head, without
the `[b, s, V/TP]` logits, and the MTP depths' losses (`--mtp-num-layers`) are added by megatron
exactly as before. Megatron-LM wraps the model in DDP after `model_provider`; installing after the
wrap works too (megatron's DDP, including `--overlap-param-gather`).
"""

from __future__ import annotations

import argparse
from typing import Callable, List, Optional

from .config import MEMORY_MODES, FusedCEConfig

# Megatron-LM's own loss flags that the fused output layer supersedes while it is installed: both
# act on the [tokens, vocab/TP] logits, which the fused path never forms. (dest, flag)
SUPERSEDED_LOSS_FLAGS = (
    ("cross_entropy_loss_fusion", "--cross-entropy-loss-fusion"),
    ("fp16_lm_cross_entropy", "--fp16-lm-cross-entropy"),
)


def add_fused_ce_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`--use-linear-ce-fusion-loss`, `--linear-ce-fusion-chunk-size`,
    `--linear-ce-fusion-memory-mode`, `--linear-ce-fusion-max-chunk-bytes` and
    `--linear-ce-fusion-logits-dtype`: the `megatron_cfg` keys of
    `FusedCEConfig.from_megatron_cfg`, as Megatron-LM flags. Returns `parser` (Megatron-LM's
    `extra_args_provider` contract)."""
    group = parser.add_argument_group("fused linear cross-entropy (megatron_fused_ce)")
    group.add_argument("--use-linear-ce-fusion-loss", action="store_true",
                       help="compute the loss from the last hidden states and the output weight "
                            "chunk by chunk, without the [tokens, vocab/TP] logits")
    group.add_argument("--linear-ce-fusion-chunk-size", type=int, default=None,
                       help="tokens per chunk of logits (default: automatic)")
    group.add_argument("--linear-ce-fusion-memory-mode", choices=MEMORY_MODES, default=None,
                       help="fast (default: chunks of logits) or lean (tiles in a fixed working set, "
                            "~2.4 %% of the logits of 8192 tokens whatever the number of tokens; slower)")
    group.add_argument("--linear-ce-fusion-max-chunk-bytes", type=int, default=None,
                       help="without a chunk size: the most bytes of logits in one chunk "
                            "(default: 1 GiB; the extra memory is flat in the number of tokens)")
    group.add_argument("--linear-ce-fusion-logits-dtype", choices=("float32",), default=None,
                       help="float32: keep the fp32 output of the logits GEMM (default: logits in the "
                            "input dtype, as Megatron's output layer)")
    return parser


def superseded_loss_flags(args) -> List[str]:
    """Megatron-LM's loss flags set in `args` that the fused output layer supersedes (empty
    without --use-linear-ce-fusion-loss)."""
    if not FusedCEConfig.from_megatron_cfg(vars(args)).enabled:
        return []
    return [flag for dest, flag in SUPERSEDED_LOSS_FLAGS if getattr(args, dest, False)]


def fused_ce_config_from_args(args, log: Optional[Callable[[str], None]] = None) -> FusedCEConfig:
    """The `FusedCEConfig` of Megatron-LM's parsed `args` (`vars(args)` read as a `megatron_cfg`),
    with Megatron-LM's own cross-entropy flags reconciled:

    - `--cross-entropy-loss-fusion` (`--cross-entropy-fusion-impl native`) and
      `--fp16-lm-cross-entropy` compute the loss from materialized logits. With
      --use-linear-ce-fusion-loss the fused output layer computes the loss of the main head and of
      every MTP depth from the hidden states instead, so they have no effect while it is installed;
      they still apply where it is not (uninstalled, or --use-linear-ce-fusion-loss off), and are
      left in `args` as given (checkpoints record them unchanged). `log`, if given, gets one line
      naming them.
    - `--cross-entropy-fusion-impl te` with `--cross-entropy-loss-fusion` is refused by
      Megatron-LM's own validation (and by megatron-core's TransformerConfig); it is refused here
      too (ValueError), so scripts that skip Megatron-LM's validation behave alike.
    """
    config = FusedCEConfig.from_megatron_cfg(vars(args))
    if (getattr(args, "cross_entropy_loss_fusion", False)
            and getattr(args, "cross_entropy_fusion_impl", "native") == "te"):
        raise ValueError("--cross-entropy-loss-fusion with --cross-entropy-fusion-impl te is not "
                         "supported by megatron-core; use --cross-entropy-fusion-impl native, or "
                         "--use-linear-ce-fusion-loss alone")
    superseded = superseded_loss_flags(args)
    if superseded and log is not None:
        log(f"> --use-linear-ce-fusion-loss: the fused output layer computes the loss from the "
            f"hidden states; {', '.join(superseded)}: acts on materialized logits, so applies "
            f"only where the fused layer is not installed")
    return config
