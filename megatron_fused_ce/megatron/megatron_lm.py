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

from .config import MEMORY_MODES


def add_fused_ce_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`--use-linear-ce-fusion-loss`, `--linear-ce-fusion-chunk-size`,
    `--linear-ce-fusion-memory-mode` and `--linear-ce-fusion-logits-dtype`: the `megatron_cfg` keys of
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
    group.add_argument("--linear-ce-fusion-logits-dtype", choices=("float32",), default=None,
                       help="float32: keep the fp32 output of the logits GEMM (default: logits in the "
                            "input dtype, as Megatron's output layer)")
    return parser
