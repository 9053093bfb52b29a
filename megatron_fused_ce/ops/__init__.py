"""The op: hidden -> (SP gather) -> chunk loop (chunked.py) -> backend math (torch_backend.py /
triton_backend.py) -> TP merge (reductions.py) -> log-probs / loss (api.py). Sampler fidelity
(top_k / top_p / min_p / return_topk): its own chunk loop in sampling.py, its per-chunk math in
sampling_torch.py / sampling_triton.py."""

from .api import LogprobsOutput, linear_cross_entropy, linear_logprobs

__all__ = ["LogprobsOutput", "linear_cross_entropy", "linear_logprobs"]
