"""megatron_fused_ce: vocab-parallel log-probs and cross-entropy straight from hidden states and the
output-layer weight shard, chunk by chunk, without the [tokens, vocab/TP] logits tensor.

    from megatron_fused_ce import linear_logprobs, linear_cross_entropy, LogprobsOutput

Losses on log-probs (SFT/DPO/GRPO) live in `megatron_fused_ce.losses`, the Megatron-Core adapters
in `megatron_fused_ce.megatron`. `check_deferred_errors()` raises what calls made without a host
synchronization found on the device (optimizer steps run it too).
"""

from .losses.linear_cross_entropy import linear_cross_entropy
from .ops import LogprobsOutput, linear_logprobs
from .ops.deferred_errors import check_deferred_errors

__all__ = ["LogprobsOutput", "check_deferred_errors", "linear_cross_entropy", "linear_logprobs"]
__version__ = "0.1.0"
