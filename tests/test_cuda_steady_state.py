"""On a GPU, the second call of a signature: no host synchronization, a bounded number of kernels,
and capturable in a CUDA graph (tests/test_steady_state.py says why and checks the same on the
CPU; tests/test_multigpu.py at TP = 2 over NCCL).

- Each path (cross-entropy, log-probs with and without entropy, forward-only log-probs, GRPO with
  every option on, GRPO whose normalizer — a CUDA tensor or a number — changes every call,
  forward-only and forward + backward log-probs with a sampling mask, and with masks keeping
  another number of ids every call) runs its second call under
  torch.cuda.set_sync_debug_mode("error").
- CUDA kernels per call, from the profiler: at most 30 for cross-entropy, log-probs and
  forward-only, at most 40 for GRPO whatever its options (the counts are printed).
- torch.cuda.graph captures the forward-only log-probs (with and without a sampling mask) and
  cross-entropy forward + backward at
  static shapes; replayed on new inputs copied into the captured ones, they give eager's values and
  gradients, bit for bit. torch.cuda.make_graphed_callables (a graph for the forward and one for
  the backward, autograd between them: how docs/performance.md runs the RL passes) does the same
  for cross-entropy, log-probs with entropy and GRPO with every option.
- A first call and later ones leave nothing in reference cycles (tests/test_reference_cycles.py).
- With the backward on the calling thread (autograd's multithreading off, docs/performance.md's
  advice for RL trainers), the same gradients, bit for bit, and no host synchronization.
"""

import contextlib
import gc

import pytest
import torch

from megatron_fused_ce import check_deferred_errors, linear_cross_entropy, linear_logprobs
from megatron_fused_ce.losses import GRPOConfig, linear_grpo_loss
from megatron_fused_ce.ops import agreement
from megatron_fused_ce.testing.gc_cycles import kinds, left_in_cycles

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA synchronizations, kernels and graphs")

N, H, V = 2048, 512, 8064  # small: the host's work per call is what this measures
GRPO_OPTION_SETS = {
    "dapo": GRPOConfig(loss_type="dapo"),
    "every_option": GRPOConfig(loss_type="dapo", delta=3.0, dual_clip_c=3.0, beta=0.05, kl_estimator="k3",
                               use_bias_correction_kl=True, is_correction="token_truncate", is_clip_max=2.0),
    "grpo_k2_sequence_mask": GRPOConfig(loss_type="grpo", beta=0.1, kl_estimator="k2",
                                        is_correction="sequence_mask", is_clip_min=0.5, is_clip_max=2.0),
}
MAX_KERNELS = {"cross_entropy": 30, "cross_entropy_per_token": 30, "logprobs": 30, "logprobs_entropy": 30,
               "forward_only": 30, "grpo": 40}
# Measured on an H200 (torch 2.11, Triton 3.6): forward-only 2 at TP = 1 (the GEMM and one launch of label
# checks and log-probs; 3 with the label and statistics kernels apart, 10 before its epilogue went into
# the statistics kernel), log-probs 9 (10 with the label kernel apart, 23 with entropy; 12
# before the row scaling read the upstream gradient of the sum in place, 17 before their statistics
# and dlogits came from one launch, 21 before the labelled log-prob took the poison and the
# backward's row scaling the label mask), cross-entropy 9 (10 with the label kernel apart, 12 with the
# statistics and dlogits kernels apart), GRPO 9 with each option set (its per-token terms: one kernel, triton_grpo.py;
# a kernel fewer where its statistics, terms and dlogits take one launch, triton_grpo.terms_in_launch_, as
# here; 12 before its remembered route's lean node: the stats launch finishing its rows at TP = 1, no zero
# anchor, the poison and the loss written by the per-token kernel; 14 before the label kernel read
# its mask; 14 with a normalizer given as a CUDA tensor, whose check on the device takes five small
# kernels, 9 with one given as a number).


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(8, N // 8, H, generator=g).bfloat16().cuda()
    w = (torch.randn(V, H, generator=g) * 0.05).bfloat16().cuda()
    y = torch.randint(0, V, (8, N // 8), generator=g)
    y[:, :16] = -100  # a prompt
    rollout = {"adv": torch.randn(8, generator=g).cuda(), "old": (-torch.rand(8, N // 8, generator=g) * 4).cuda()}
    return h, w, y.cuda(), rollout


def _paths():
    """name -> call(inputs): the inputs are made before (their host-to-device copies are not the op's)."""
    def forward_only(inputs):
        h, w, y, _ = inputs
        with torch.no_grad():
            return linear_logprobs(h, w, y).logprobs

    def logprobs(inputs, entropy=False):
        h, w, y, _ = inputs
        out = linear_logprobs(h, w, y, return_entropy=entropy)
        (out.logprobs.sum() + (out.entropy.sum() if entropy else 0)).backward()
        return out.logprobs

    def cross_entropy(inputs):
        h, w, y, _ = inputs
        loss = linear_cross_entropy(h, w, y)
        loss.backward()
        return loss

    def cross_entropy_per_token(inputs):  # (Megatron's output layer: per-token losses, its loss function's sum)
        h, w, y, _ = inputs
        losses = linear_cross_entropy(h, w, y, reduction="none")
        losses.sum().backward()
        return losses

    def grpo(inputs, config):
        h, w, y, r = inputs
        loss, metrics = linear_grpo_loss(h, w, r["labels"], r["adv"], r["mask"], config, old_logprobs=r["old"],
                                         reference_logprobs=r["reference"], sampling_logprobs=r["sampling"])
        loss.backward()
        return loss

    def grpo_normalizer(inputs, kind):
        # a global token count, another every call: a CUDA tensor (checked on the device) or a number
        # (compared across ranks, not in the signature)
        h, w, y, r = inputs
        loss, _ = linear_grpo_loss(h, w, r["labels"], r["adv"], r["mask"], GRPO_OPTION_SETS["dapo"],
                                   old_logprobs=r["old"], normalizer=r["count"] if kind == "tensor" else r["count_value"])
        loss.backward()
        return loss

    paths = {"forward_only": forward_only, "logprobs": logprobs,
             "logprobs_entropy": lambda inputs: logprobs(inputs, True), "cross_entropy": cross_entropy,
             "cross_entropy_per_token": cross_entropy_per_token}
    for name, config in GRPO_OPTION_SETS.items():
        paths[f"grpo:{name}"] = lambda inputs, config=config: grpo(inputs, config)
    for kind in ("tensor", "number"):
        paths[f"grpo:normalizer_{kind}_changing"] = lambda inputs, kind=kind: grpo_normalizer(inputs, kind)
    return paths


def _sampling_mask(y, seed, k=8):
    """On the GPU, sizes fixed: k ids (the label among them) at every labelled position, none in the prompt."""
    g = torch.Generator().manual_seed(seed + 100)
    step = torch.randint(1, V // k, (y.shape[0], 1, 1), generator=g).cuda()
    ids = ((y[:, 16:, None] + torch.arange(k, device="cuda") * step) % V).reshape(-1)
    sizes = torch.zeros(y.shape, dtype=torch.int64, device="cuda")
    sizes[:, 16:] = k
    return ids, torch.cat([torch.zeros(1, dtype=torch.int64, device="cuda"), sizes.reshape(-1).cumsum(0)])


def _replay_paths():
    """name -> call(inputs) of log-probs with a sampling mask (in the inputs' rollout)."""
    def forward_only(inputs):
        h, w, y, r = inputs
        with torch.no_grad():
            return linear_logprobs(h, w, y, sampling_mask=r["sampling_mask"]).logprobs

    def logprobs(inputs):
        h, w, y, r = inputs
        out = linear_logprobs(h, w, y, return_entropy=True, sampling_mask=r["sampling_mask"])
        (out.logprobs.sum() + out.entropy.sum()).backward()
        return out.logprobs

    def sparse(inputs):  # (K = 8 of V = 8064 takes the union tiles by sizes)
        with _route("sparse"):
            return logprobs(inputs)

    def other_count(inputs):  # another number of kept ids every call (a sampler's sets change size)
        h, w, y, r = inputs
        out = linear_logprobs(h, w, y, sampling_mask=r["sampling_mask_other_count"])
        out.logprobs.sum().backward()
        return out.logprobs

    return {"replay_forward_only": forward_only, "replay_logprobs": logprobs, "replay_sparse_logprobs": sparse,
            "replay_logprobs_another_count_of_ids": other_count}


@contextlib.contextmanager
def _route(pieces):
    """replay.FORCE_PIECES set to `pieces` while the block runs."""
    from megatron_fused_ce.ops import replay

    replay.FORCE_PIECES = pieces
    try:
        yield
    finally:
        replay.FORCE_PIECES = None


def _leaves(seed):
    h, w, y, rollout = _inputs(seed)
    rollout.update(labels=y.clamp(min=0), mask=(y != -100).float(), reference=rollout["old"] - 0.1,
                   sampling=rollout["old"] + 0.05, sampling_mask=_sampling_mask(y, seed),
                   sampling_mask_other_count=_sampling_mask(y, seed, k=6 + seed), count_value=1500.0 + seed,
                   count=torch.full((), 1500.0 + seed, device="cuda"))
    return h.requires_grad_(), w.requires_grad_(), y, rollout


@pytest.mark.parametrize("name", list(_paths()) + list(_replay_paths()))
def test_second_call_makes_no_host_synchronization(name):
    call = {**_paths(), **_replay_paths()}[name]
    call(_leaves(1))
    inputs = _leaves(2)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = call(inputs)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(out).all()
    check_deferred_errors()


# Replay's remembered route (union tiles, every labelled row with a set), CUDA kernels per call with
# the test's own sum and backward, measured on an H200 (torch 2.11, Triton 3.6): forward + backward
# 17, forward-only 9: the statistics' launch finishing the rows (no tail launch, no fill of
# placeholders) and the layout checking the labels (no label kernel), 3 kernels fewer. (A
# benchmark step at 2048 x 4096 x 19008 made 59 before dW's columns were ordered by classes of use
# in two launches instead of torch's sort, the columns counted by the layout kernel, z read off the
# products by the statistics kernel and the dlogits written into both products' blocks by their
# kernel, which reads the upstream gradient and the row masks itself; 35 after; 27 with both
# tilings' layouts made in one set of launches, each numbered by its packing launch instead of
# torch's cumsum; 21 now.)
MAX_REPLAY_KERNELS = {"replay_logprobs_another_count_of_ids": 17, "replay_forward_only": 9}


@pytest.mark.parametrize("name", list(_paths()) + list(MAX_REPLAY_KERNELS))
def test_kernels_per_call_are_bounded(name, record_property):
    call = {**_paths(), **_replay_paths()}[name]
    call(_leaves(1))
    call(_leaves(2))
    inputs = _leaves(3)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call(inputs)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    record_property("kernels", len(kernels))
    print(f"{name}: {len(kernels)} CUDA kernels per call: " + " | ".join(k[:60] for k in kernels))
    bound = MAX_REPLAY_KERNELS[name] if name in MAX_REPLAY_KERNELS else MAX_KERNELS[name.split(":")[0]]
    assert len(kernels) <= bound, kernels


@pytest.mark.parametrize("name", list(_paths()) + list(_replay_paths()))
def test_first_and_later_calls_leave_no_reference_cycles(name):
    """Nothing left to Python's cyclic collector (tests/test_reference_cycles.py says why) by a
    first call or by later ones, whose remembered routes launch the Triton kernels the CPU's test
    interprets; their kernels compiled before (Triton's compiler leaves cycles of its own, once)."""
    call = {**_paths(), **_replay_paths()}[name]
    first_inputs, later_inputs = _leaves(1), _leaves(2)
    # every kernel compiled (Triton's garbage), a first call's too (an earlier test's call of the same
    # signature would make this one a later call)
    agreement.forget_signatures()
    for inputs in (first_inputs, later_inputs, later_inputs):
        call(inputs)
    agreement.forget_signatures()
    first = left_in_cycles(lambda: call(first_inputs))
    later = left_in_cycles(lambda: call(later_inputs), 3)
    assert not first, f"first call: {kinds(first)}"
    assert not later, f"later calls: {kinds(later)}"


def _collect_dropped_graphs():
    """docs/performance.md's step before a capture: the graphs of earlier tests (make_graphed_callables'
    live in reference cycles) freed now, not by a garbage collection that happens to run during the
    capture, where their destruction invalidates it ("operation failed due to a previous error
    during capture"; torch collects at a capture's start only with TORCH_CUDAGRAPH_GC=1). Without
    it, 1 to 4 of 12 rounds of the three make_graphed_callables tests failed on an H200; none with
    the collector off."""
    gc.collect()


def _capture(fn, static_args, warmups=3):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn(*static_args)
    torch.cuda.current_stream().wait_stream(stream)
    _collect_dropped_graphs()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static_args)
    return graph, out


def test_forward_only_logprobs_replay_in_a_cuda_graph():
    h, w, y, _ = _inputs(4)

    def forward(h, w, y):
        with torch.no_grad():
            return linear_logprobs(h, w, y, return_entropy=True)

    graph, out = _capture(forward, (h, w, y))
    for seed in (5, 6):
        h2, w2, y2, _ = _inputs(seed)
        h.copy_(h2), w.copy_(w2), y.copy_(y2)
        graph.replay()
        eager = forward(h2, w2, y2)
        assert torch.equal(out.logprobs, eager.logprobs) and torch.equal(out.entropy, eager.entropy), seed
    check_deferred_errors()


@pytest.mark.parametrize("pieces", [None, "sparse"])  # (None: the union tiles, by sizes)
def test_forward_only_logprobs_with_a_sampling_mask_replay_in_a_cuda_graph(pieces):
    h, w, y, _ = _inputs(4)
    ids, offsets = _sampling_mask(y, 4)

    def forward(h, w, y, ids, offsets):
        with torch.no_grad(), _route(pieces):
            return linear_logprobs(h, w, y, return_entropy=True, sampling_mask=(ids, offsets))

    graph, out = _capture(forward, (h, w, y, ids, offsets))
    for seed in (5, 6):
        h2, w2, y2, _ = _inputs(seed)
        ids2, offsets2 = _sampling_mask(y2, seed)
        h.copy_(h2), w.copy_(w2), y.copy_(y2), ids.copy_(ids2), offsets.copy_(offsets2)
        graph.replay()
        eager = forward(h2, w2, y2, ids2, offsets2)
        assert torch.equal(out.logprobs, eager.logprobs) and torch.equal(out.entropy, eager.entropy), seed
    check_deferred_errors()


def test_cross_entropy_forward_backward_replay_in_a_cuda_graph():
    h, w, y, _ = _inputs(7)
    h.requires_grad_(), w.requires_grad_()

    def step(h, w, y):
        h.grad = w.grad = None
        loss = linear_cross_entropy(h, w, y)
        loss.backward()
        return loss.detach(), h.grad, w.grad

    graph, (loss, dx, dw) = _capture(step, (h, w, y))
    for seed in (8, 9):
        h2, w2, y2, _ = _inputs(seed)
        with torch.no_grad():
            h.copy_(h2), w.copy_(w2), y.copy_(y2)
        graph.replay()
        h3, w3 = h2.clone().requires_grad_(), w2.clone().requires_grad_()
        eager = linear_cross_entropy(h3, w3, y2)
        eager.backward()
        assert torch.equal(loss, eager.detach()), seed
        assert torch.equal(dx, h3.grad) and torch.equal(dw, w3.grad), seed
    check_deferred_errors()


@pytest.mark.parametrize("name", ["cross_entropy", "logprobs_entropy", "grpo:every_option"])
def test_make_graphed_callables_gives_eager_values_and_gradients(name):
    """The recipe of docs/performance.md: the loss as a function of (hidden, weight, labels, per-token
    inputs), graphed by torch; on new inputs the loss and dX, dW equal eager's, bit for bit."""
    if name == "cross_entropy":
        def loss_of(h, w, y, old, adv):
            return linear_cross_entropy(h, w, y)
    elif name == "logprobs_entropy":
        def loss_of(h, w, y, old, adv):
            out = linear_logprobs(h, w, y, return_entropy=True)
            return -out.logprobs.mean() - 0.01 * out.entropy.mean()
    else:
        config = GRPO_OPTION_SETS["every_option"]

        def loss_of(h, w, y, old, adv):
            return linear_grpo_loss(h, w, y.clamp(min=0), adv, (y != -100).float(), config,
                                    old_logprobs=old, reference_logprobs=old - 0.1, sampling_logprobs=old + 0.05)[0]

    h, w, y, rollout = _leaves(10)
    _collect_dropped_graphs()
    graphed = torch.cuda.make_graphed_callables(loss_of, (h, w, y, rollout["old"], rollout["adv"]))
    for seed in (11, 12):
        h2, w2, y2, rollout2 = _leaves(seed)
        loss = graphed(h2, w2, y2, rollout2["old"], rollout2["adv"])
        dx, dw = torch.autograd.grad(loss, (h2, w2))
        h3, w3 = h2.detach().clone().requires_grad_(), w2.detach().clone().requires_grad_()
        eager = loss_of(h3, w3, y2, rollout2["old"], rollout2["adv"])
        ex, ew = torch.autograd.grad(eager, (h3, w3))
        assert torch.equal(loss.detach(), eager.detach()), seed
        assert torch.equal(dx, ex) and torch.equal(dw, ew), seed
    check_deferred_errors()


@pytest.mark.parametrize("name", ["cross_entropy", "logprobs_entropy", "grpo:every_option", "replay_logprobs"])
def test_backward_on_the_calling_thread_gives_the_same_bits_without_a_sync(name):
    """docs/performance.md has RL trainers run their backward on the calling thread
    (torch.autograd.set_multithreading_enabled(False): autograd's hand-off to its device thread is
    ~0.3 ms of host a backward on the H200 hosts measured). There the op's backward must give what
    it gives on the device thread, bit for bit, and a later call still make no host
    synchronization."""
    import threading

    call = {**_paths(), **_replay_paths()}[name]
    call(_leaves(1))
    h, w, y, rollout = _leaves(2)
    expected = (call((h, w, y, rollout)), h.grad, w.grad)
    h, w, y, rollout = _leaves(2)
    threads = set()
    h.register_hook(lambda grad: threads.add(threading.get_ident()))
    torch.cuda.synchronize()
    with torch.autograd.set_multithreading_enabled(False):
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = call((h, w, y, rollout))
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert threads == {threading.get_ident()}  # (the hook ran in the backward, on this thread)
    for got, want in zip((out, h.grad, w.grad), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    check_deferred_errors()
