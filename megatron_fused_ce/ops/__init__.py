"""The op: hidden -> (SP gather) -> chunk loop (chunked.py; lean tiles: lean.py) -> backend math
(backends/: torch, Triton, QuACK's capabilities) -> TP merge (reductions.py) -> log-probs / loss
(api.py); losses whose gradients are made in the forward: forward_grad.py. Sampler fidelity (top_k / top_p / min_p / return_topk): its own chunk loop in sampling.py,
its per-chunk kernels in the backends. Sampling-mask replay (the engine's kept sets): replay.py."""

from .api import LogprobsOutput, linear_logprobs
from .forward_grad import PER_ROW, ForwardGradLoss, TokenGrads
from .replay import SamplingMask, build_sampling_mask, flat_positions, slice_sampling_mask

__all__ = ["LogprobsOutput", "linear_logprobs", "ForwardGradLoss", "TokenGrads", "PER_ROW", "SamplingMask",
           "build_sampling_mask", "slice_sampling_mask", "flat_positions"]
