"""The op: hidden -> (SP gather) -> chunk loop (chunked.py) -> backend math (torch_backend.py /
triton_backend.py) -> TP merge (reductions.py) -> log-probs / loss (api.py)."""

from .api import LogprobsOutput, linear_cross_entropy, linear_logprobs

__all__ = ["LogprobsOutput", "linear_cross_entropy", "linear_logprobs"]
