"""The op: hidden -> (SP gather) -> chunk loop (chunked.py, walking the rows and the vocab as its
tiling says: fast.py's chunks, lean.py's tiles, sampling.py's kept-set chunks for the sampler
settings top_k / top_p / min_p / return_topk, or replay.py's kept entries for a sampling mask) ->
backend math (backends/: torch, Triton, QuACK's capabilities) -> TP merge (reductions.py) ->
log-probs / loss (api.py). Losses whose gradients are made in the forward: forward_grad.py;
Megatron's main_grad: main_grad.py. Sampling-mask replay (the engine's kept sets): replay.py's
tiling, its kept-set kernels in the backends (replay_torch.py, replay_triton.py)."""

from .api import LogprobsOutput, linear_logprobs
from .forward_grad import PER_ROW, ForwardGradLoss, TokenGrads
from .replay import SamplingMask, build_sampling_mask, flat_positions, slice_sampling_mask

__all__ = ["LogprobsOutput", "linear_logprobs", "ForwardGradLoss", "TokenGrads", "PER_ROW", "SamplingMask",
           "build_sampling_mask", "slice_sampling_mask", "flat_positions"]
