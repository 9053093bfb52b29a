"""A call leaves nothing in reference cycles.

Whatever a call leaves in a reference cycle waits for Python's cyclic collector: at RL row counts
a collection of 0.3-0.8 ms every few calls on an H200 host (a GRPO call whose node's context kept
the node's own output left 62 objects a call: a collection every ~11 calls, and now and then a
full one of ~60 ms), and under Megatron's manual garbage collection (the collector off between its
explicit runs) the tensors in those cycles stay allocated until the next run. So each path's first
and later calls (the general path, then the remembered routes) run under gc.DEBUG_SAVEALL here, at
TP = 1 and 2 (and GRPO at CP = 2), and nothing may be found.

GRPO's route with its per-token kernel (which writes the loss on its own: the object that made the
cycle) runs under Triton's interpreter on a CPU; the interpreter's launcher makes cycles of its own
(local functions that refer to themselves), so there what must not be found are tensors,
autograd's nodes and the package's objects. tests/test_cuda_steady_state.py checks every path on
a GPU, where nothing at all may be found.
"""

import os

import pytest
import torch
import torch.distributed as dist

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from dist import run_workers  # noqa: E402
from sampling_mask_cases import random_sets  # noqa: E402
from megatron_fused_ce import linear_cross_entropy, linear_logprobs  # noqa: E402
from megatron_fused_ce.losses import GRPOConfig, linear_grpo  # noqa: E402
from megatron_fused_ce.losses import linear_grpo_loss  # noqa: E402
from megatron_fused_ce.ops import agreement  # noqa: E402
from megatron_fused_ce.testing.gc_cycles import kinds, left_in_cycles  # noqa: E402

B, T, H, V, VOCAB = 4, 8, 16, 80, 75  # V rows of the weight, VOCAB of them real (a padded vocab)
EVERY_OPTION = GRPOConfig(loss_type="dapo", delta=3.0, dual_clip_c=3.0, beta=0.05, kl_estimator="k3",
                          use_bias_correction_kl=True, is_correction="token_truncate", is_clip_max=2.0)


def _inputs(rank=0, world=1):
    """Hidden [B, T, H], this rank's shard of the weight, labels with a prompt, a rollout."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(B, T, H, generator=g).requires_grad_()
    w = torch.randn(V, H, generator=g) * 0.3
    w = w[rank * V // world:(rank + 1) * V // world].clone().requires_grad_()
    y = torch.randint(0, VOCAB, (B, T), generator=g)
    y[:, :2] = -100  # a prompt
    old = torch.randn(B, T, generator=g) * 0.3 - 3.5
    rollout = dict(adv=torch.randn(B, generator=g), mask=(y != -100).float(), labels=y.clamp(min=0), old=old,
                   reference=old - 0.1, sampling=old + 0.05,
                   sampling_mask=random_sets(g, B * T, VOCAB, y.reshape(-1)))
    return h, w, y, rollout


def _grpo(config, impl="auto"):
    def call(h, w, y, r, **common):
        loss, _ = linear_grpo_loss(h, w, r["labels"], r["adv"], r["mask"], config, impl=impl, old_logprobs=r["old"],
                                   reference_logprobs=r["reference"] if config.beta > 0 else None,
                                   sampling_logprobs=r["sampling"], **common)
        loss.backward()
    return call


def _logprobs(replay=False, **kwargs):
    def call(h, w, y, r, **common):
        mask = {"sampling_mask": r["sampling_mask"]} if replay else {}
        out = linear_logprobs(h.reshape(-1, H), w, y.reshape(-1), **kwargs, **mask, **common)
        (out.logprobs.sum() + (out.entropy.sum() if out.entropy is not None else 0)).backward()
    return call


def _cross_entropy(**kwargs):
    def call(h, w, y, r, **common):
        linear_cross_entropy(h, w, y, **kwargs, **common).sum().backward()
    return call


def _forward_only(h, w, y, r, **common):
    with torch.no_grad():
        linear_logprobs(h, w, y, **common)


PATHS = {
    "forward_only": _forward_only,
    "logprobs": _logprobs(),
    "logprobs_entropy": _logprobs(return_entropy=True),
    "logprobs_several_chunks": _logprobs(chunk_size=7),
    "logprobs_top_k": _logprobs(top_k=5, temperature=0.7),
    "replay": _logprobs(return_entropy=True, replay=True),
    "cross_entropy": _cross_entropy(),
    "cross_entropy_per_token": _cross_entropy(reduction="none"),
    "cross_entropy_lean": _cross_entropy(memory_mode="lean"),
    "grpo": _grpo(GRPOConfig()),
    "grpo_every_option": _grpo(EVERY_OPTION),
}


# GRPO under context parallelism (the world as the CP group, the whole weight on every rank): its
# token-level and sequence-level paths
CP_PATHS = {"grpo_context_parallel": _grpo(GRPOConfig()),
            "grpo_sequence_level_context_parallel": _grpo(GRPOConfig(loss_type="grpo", beta=0.1,
                                                                     importance_sampling_level="sequence"))}


def _cycles_worker(rank, world):
    """{path: (kinds left by its first call, by its three later calls)} on this rank."""
    tp = dict(tp_group=dist.group.WORLD, vocab_size=VOCAB) if world > 1 else dict(vocab_size=VOCAB)
    cases = [(name, path, _inputs(rank, world), tp) for name, path in PATHS.items()]
    if world > 1:
        cp = dict(cp_group=dist.group.WORLD, vocab_size=VOCAB)
        cases += [(name, path, _inputs(), cp) for name, path in CP_PATHS.items()]
    report = {}
    for name, path, inputs, common in cases:
        agreement.forget_signatures()
        first = left_in_cycles(lambda: path(*inputs, **common), 1)  # the general path
        later = left_in_cycles(lambda: path(*inputs, **common), 3)  # remembered routes, where the path has one
        report[name] = (kinds(first), kinds(later))
    return report


@pytest.mark.parametrize("tp", [1, 2])
def test_first_and_later_calls_leave_no_reference_cycles(tp):
    # (at TP = 2 its many paths take ~35 s on a quiet 2-core machine: a limit that a loaded one keeps)
    reports = [_cycles_worker(0, 1)] if tp == 1 else run_workers(_cycles_worker, tp, timeout=240)
    for rank, report in enumerate(reports):
        for name, (first, later) in report.items():
            assert not first, f"rank {rank}, {name}, first call: {first}"
            assert not later, f"rank {rank}, {name}, later calls: {later}"


def _ours(o) -> bool:
    kind = type(o)
    return (isinstance(o, torch.Tensor) or kind.__module__.startswith("megatron_fused_ce")
            or kind.__name__.endswith("Backward") or isinstance(o, torch.autograd.function.FunctionCtx))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU's test: tests/test_cuda_steady_state.py")
@pytest.mark.parametrize("config", [GRPOConfig(), EVERY_OPTION], ids=["dapo", "every_option"])
def test_grpo_route_with_its_per_token_kernel_leaves_no_reference_cycles(config, monkeypatch):
    from triton_interpret import kernel_modules

    module, ran = kernel_modules()["triton_grpo"], []

    def counted(kernel):
        def run(*args, **kwargs):
            ran.append(1)
            return kernel(*args, **kwargs)
        return run

    # (its one launch of statistics, terms and dlogits where it applies, else the per-token kernel)
    monkeypatch.setattr(linear_grpo, "_whole_call_kernel", lambda: counted(module.whole_call_terms))
    monkeypatch.setattr(linear_grpo, "_one_launch_kernel", lambda: counted(module.terms_in_launch_))
    agreement.forget_signatures()
    path, inputs = _grpo(config, impl="triton"), _inputs()
    first = [o for o in left_in_cycles(lambda: path(*inputs), 1) if _ours(o)]
    later = [o for o in left_in_cycles(lambda: path(*inputs), 3) if _ours(o)]
    assert len(ran) == 4, "the per-token kernel did not run every call"
    assert not first, f"first call: {kinds(first)}"
    assert not later, f"later calls: {kinds(later)}"
