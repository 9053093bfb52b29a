"""megatron_fused_ce: vocab-parallel log-probs and cross-entropy straight from hidden states and the
output-layer weight shard, chunk by chunk, without the [tokens, vocab/TP] logits tensor.

    from megatron_fused_ce import linear_logprobs, linear_cross_entropy, LogprobsOutput

Losses on log-probs (SFT/DPO/GRPO) live in `megatron_fused_ce.losses`, the Megatron-Core adapters
in `megatron_fused_ce.megatron`.
"""

from .losses.linear_cross_entropy import linear_cross_entropy
from .ops import LogprobsOutput, linear_logprobs

__all__ = ["LogprobsOutput", "linear_cross_entropy", "linear_logprobs"]
__version__ = "0.1.0"
