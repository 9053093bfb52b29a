"""Float64 dense reference of the sampler-fidelity semantics (linear_logprobs' top_k / top_p / min_p
/ return_topk), written straight from the definition, on materialized logits.

Per row, with z the [V] float64 logits / temperature of the unpadded vocab:
  min_p: keep p_k >= min_p * max p (min_p = 1: the tokens tied with the max);
  top_k: keep z >= (k-th largest kept z); None, 0 and -1 (vLLM's spellings) keep everything;
  top_p: walking z descending then id ascending over the renormalized remainder, keep a token iff
         the mass strictly before it is < top_p;  then renormalize over the kept set.
"""

import torch


def kept_set(z: torch.Tensor, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """[N, V] bool kept set of each row of `z` (float64, no grad needed)."""
    z = z.detach().double()
    n, v = z.shape
    keep = torch.ones(n, v, dtype=torch.bool)
    if min_p:
        p = torch.softmax(z, dim=-1)
        keep &= p >= min_p * p.max(dim=-1, keepdim=True).values
    if top_k is not None and 0 < top_k < v:
        remaining = torch.where(keep, z, float("-inf"))
        kth = remaining.sort(dim=-1, descending=True).values[:, top_k - 1:top_k]
        keep &= z >= kth
    if top_p is not None and top_p < 1.0:
        # total order: z descending, then id ascending (a stable sort of -z keeps ids ascending)
        order = torch.sort(-z, dim=-1, stable=True).indices
        q = torch.softmax(torch.where(keep, z, float("-inf")), dim=-1)
        q_sorted = q.gather(1, order)
        before = torch.cat([torch.zeros(n, 1, dtype=z.dtype), torch.cumsum(q_sorted, dim=-1)[:, :-1]], dim=-1)
        kept_sorted = before < top_p
        keep &= torch.zeros_like(keep).scatter(1, order, kept_sorted)
    return keep


def processed_stats(z: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor, ignore_index=-100):
    """Differentiable log q(label) (-inf outside the kept set, 0 at ignored) and entropy of q."""
    lse = torch.logsumexp(torch.where(keep, z, float("-inf")), dim=-1, keepdim=True)
    logq = z - lse
    q = torch.where(keep, logq.exp(), 0.0)
    entropy = -torch.where(keep, q * logq, 0.0).sum(-1)
    scored = labels != ignore_index
    y = labels.clamp(0, z.shape[1] - 1).unsqueeze(1)
    label_kept = keep.gather(1, y).squeeze(1)
    lp = torch.where(label_kept, logq.gather(1, y).squeeze(1), float("-inf"))
    lp = torch.where(scored, lp, 0.0)
    entropy = torch.where(scored, entropy, 0.0)
    return lp, entropy


def topk_reference(z: torch.Tensor, k: int):
    """(log-probs under the full softmax, ids) of the k first tokens in (z desc, id asc) order."""
    z = z.detach().double()
    order = torch.sort(-z, dim=-1, stable=True).indices[:, :k]
    return torch.log_softmax(z, dim=-1).gather(1, order), order
