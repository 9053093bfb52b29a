"""The op: hidden -> (SP gather) -> chunk loop (chunked.py; lean tiles: lean.py) -> backend math
(backends/: torch, Triton, QuACK's capabilities) -> TP merge (reductions.py) -> log-probs / loss
(api.py). Sampler fidelity (top_k / top_p / min_p / return_topk): its own chunk loop in sampling.py,
its per-chunk kernels in the backends."""

from .api import LogprobsOutput, linear_cross_entropy, linear_logprobs

__all__ = ["LogprobsOutput", "linear_cross_entropy", "linear_logprobs"]
