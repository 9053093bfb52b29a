"""The op: hidden -> (SP gather) -> chunk loop (chunked.py, walking the rows and the vocab as its
tiling says: fast.py's chunks or lean.py's tiles) -> backend math (backends/: torch, Triton,
QuACK's capabilities) -> TP merge (reductions.py) -> log-probs / loss (api.py). Losses whose
gradients are made in the forward: forward_grad.py; Megatron's main_grad: main_grad.py. Sampler
fidelity (top_k / top_p / min_p / return_topk) and sampling-mask replay (the engine's kept sets):
their own chunk loops in sampling.py and replay.py, their per-chunk kernels in the backends."""

from .api import LogprobsOutput, linear_logprobs
from .forward_grad import PER_ROW, ForwardGradLoss, TokenGrads
from .replay import SamplingMask, build_sampling_mask, flat_positions, slice_sampling_mask

__all__ = ["LogprobsOutput", "linear_logprobs", "ForwardGradLoss", "TokenGrads", "PER_ROW", "SamplingMask",
           "build_sampling_mask", "slice_sampling_mask", "flat_positions"]
