"""Steady state: the second call of a signature makes no host read and only the math's collectives.

The first call of a signature (the Python-level arguments, shapes, dtypes, group) runs the full
argument agreement: one small all-reduce and one read-back. A later call of the same signature
skips both (ops/agreement.py): its contents are checked on the device, labels and per-token inputs
are compared across TP ranks by fingerprints that ride on the statistics' all-gather, and what
is found is raised at the next host synchronization (ops/deferred_errors.py), the results being
NaN until then. The rows of ignored labels go through the chunk loop (with a zero gradient), so no
count sizes anything.

Counted on the CPU (gloo): host reads (aten's `_local_scalar_dense`, `nonzero`, `Tensor.tolist`)
and tensors made from host data (`torch.tensor`, `torch.as_tensor`: host-to-device copies on a
GPU), which is what a CUDA synchronization is on a GPU, where tests/test_cuda_steady_state.py asserts it under
torch.cuda.set_sync_debug_mode("error")) and collectives of the second call, per path, at TP = 1
and 2: forward-only log-probs 2 collectives, cross-entropy / log-probs (± entropy) / GRPO forward
+ backward 3 (two for the statistics, one for dX), none of them the agreement; the same with a
sampling mask (replay, sparse and dense, and GRPO with one, with and without a set at every
labelled position), whose steady calls make the full check's call's GEMMs (no plain pass where
every labelled row has a set) and its values, bit for bit. And the deferred checks: bad labels,
labels or GRPO inputs that differ across ranks, a sampling mask with an id twice in a set, an id
out of range or that differs across ranks, or a labelled position without a set where the
signature's first call had none, in a steady call, give NaN and raise at the next check on every
rank; a first call with such positions keeps the plain pass, exact in later calls.
"""

import contextlib
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from dist import run_workers
from sampling_mask_cases import keep_matrix
from megatron_fused_ce import check_deferred_errors, linear_cross_entropy, linear_logprobs
from megatron_fused_ce.losses import GRPOConfig, linear_grpo_loss
from megatron_fused_ce.ops import agreement, replay

COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
               "reduce_scatter_single", "all_gather", "broadcast", "reduce_scatter", "all_to_all_single")
HOST_READS = ("_local_scalar_dense", "nonzero", "is_nonzero")
GRPO_EVERY_OPTION = GRPOConfig(loss_type="dapo", delta=3.0, dual_clip_c=3.0, beta=0.05, kl_estimator="k3",
                               use_bias_correction_kl=True, is_correction="token_truncate", is_clip_max=2.0)


class _HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in HOST_READS:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _counting():
    """(collectives, host reads) made inside, as lists of names."""
    collectives, originals = [], {}
    for name in COLLECTIVES:
        if hasattr(dist, name):
            originals[name] = getattr(dist, name)

            def counted(*args, _name=name, **kwargs):
                collectives.append(_name)
                return originals[_name](*args, **kwargs)

            setattr(dist, name, counted)
    tolist = torch.Tensor.tolist

    reads = _HostReads()

    def counted_tolist(self):
        reads.ops.append("tolist")
        return tolist(self)

    torch.Tensor.tolist = counted_tolist
    try:
        with _HostData(reads.ops), reads:
            yield collectives, reads.ops
    finally:
        torch.Tensor.tolist = tolist
        for name, original in originals.items():
            setattr(dist, name, original)


class _HostData(TorchFunctionMode):
    """A tensor made from host data: a host-to-device copy on a GPU (synchronizing, and refused
    inside a CUDA graph capture)."""

    def __init__(self, found):
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.tensor, torch.as_tensor) and args and not isinstance(args[0], torch.Tensor):
            self.found.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _inputs(seed, rows=24, hidden=16, v_local=40):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(4, rows // 4, hidden, generator=g)
    w = torch.randn(v_local * 2, hidden, generator=g) * 0.3
    y = torch.randint(0, 75, (4, rows // 4), generator=g)
    y[:, 0] = -100
    return h, w, y


def _sampling_mask(y, seed, k=3, every=False):
    """Kept sets of k ids (the label among them, ids label + j * step mod 75) at positions 2-5 of
    each row; column 0 (ignored) and column 1 (labelled) keep none. `every`: at every labelled
    position (1-5; RL's case: each generated token comes with the sampler's set). Made by tensor
    ops alone (nothing read on the host): the same sizes for every seed."""
    g = torch.Generator().manual_seed(seed + 100)
    step = torch.randint(1, 20, (y.shape[0], 1, 1), generator=g)
    first = 1 if every else 2
    ids = ((y[:, first:, None] + torch.arange(k) * step) % 75).reshape(-1)
    sizes = torch.zeros(y.shape, dtype=torch.int64)
    sizes[:, first:] = k
    return ids, torch.cat([torch.zeros(1, dtype=torch.int64), sizes.reshape(-1).cumsum(0)])


def _paths(group, rank, world):
    """name -> a call (first and second: fresh inputs of the same signature)."""
    def shard(w):
        v = w.shape[0] // world
        return w[rank * v:(rank + 1) * v]

    def leaves(seed):
        h, w, y = _inputs(seed)
        return h.requires_grad_(), shard(w).clone().requires_grad_(), y

    common = dict(tp_group=group, vocab_size=75)

    def forward_only(seed):
        h, w, y = leaves(seed)
        with torch.no_grad():
            return linear_logprobs(h, w, y, **common).logprobs

    def logprobs(seed, entropy=False):
        h, w, y = leaves(seed)
        out = linear_logprobs(h, w, y, **common, return_entropy=entropy)
        (out.logprobs.sum() + (out.entropy.sum() if entropy else 0)).backward()
        return out.logprobs.detach()

    def cross_entropy(seed):
        h, w, y = leaves(seed)
        loss = linear_cross_entropy(h, w, y, **common)
        loss.backward()
        return loss.detach()

    def grpo(seed):
        h, w, y = leaves(seed)
        g = torch.Generator().manual_seed(seed + 1)
        mask = (y != -100).float()
        old = -torch.rand(y.shape, generator=g) * 3
        loss, _ = linear_grpo_loss(h, w, y.clamp(min=0), torch.randn(4, generator=g), mask, GRPO_EVERY_OPTION,
                                   old_logprobs=old, reference_logprobs=old - 0.1,
                                   sampling_logprobs=old + 0.05, **common)
        loss.backward()
        return loss.detach()

    def replay_forward_only(seed, every=False):
        h, w, y = leaves(seed)
        with torch.no_grad():
            return linear_logprobs(h, w, y, **common, sampling_mask=_sampling_mask(y, seed, every=every)).logprobs

    def replay_logprobs(seed, pieces, every=False):
        h, w, y = leaves(seed)
        replay.FORCE_PIECES = pieces
        try:
            out = linear_logprobs(h, w, y, **common, return_entropy=True,
                                  sampling_mask=_sampling_mask(y, seed, every=every))
            (out.logprobs.sum() + out.entropy.sum()).backward()
        finally:
            replay.FORCE_PIECES = None
        return torch.cat([out.logprobs.detach().reshape(-1), h.grad.reshape(-1), w.grad.reshape(-1)])

    def replay_grpo(seed):
        h, w, y = leaves(seed)
        g = torch.Generator().manual_seed(seed + 1)
        old = -torch.rand(y.shape, generator=g) * 3
        loss, _ = linear_grpo_loss(h, w, y.clamp(min=0), torch.randn(4, generator=g), (y != -100).float(),
                                   GRPO_EVERY_OPTION, old_logprobs=old, reference_logprobs=old - 0.1,
                                   sampling_logprobs=old + 0.05, sampling_mask=_sampling_mask(y, seed), **common)
        loss.backward()
        return torch.cat([loss.detach().reshape(1), h.grad.reshape(-1)])

    return {"forward_only": forward_only, "logprobs": logprobs,
            "logprobs_entropy": lambda seed: logprobs(seed, entropy=True),
            "cross_entropy": cross_entropy, "grpo": grpo, "replay_forward_only": replay_forward_only,
            "replay_logprobs_sparse": lambda seed: replay_logprobs(seed, "sparse"),
            "replay_logprobs_dense": lambda seed: replay_logprobs(seed, "dense"), "replay_grpo": replay_grpo,
            "replay_every_forward_only": lambda seed: replay_forward_only(seed, every=True),
            "replay_every_logprobs_sparse": lambda seed: replay_logprobs(seed, "sparse", every=True),
            "replay_every_logprobs_dense": lambda seed: replay_logprobs(seed, "dense", every=True)}


GEMMS = ("mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "mv", "dot")


class _Gemms(TorchDispatchMode):
    """Counts the matrix products made inside (a plain log-prob pass adds its chunk GEMMs)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in GEMMS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _steady_worker(rank, world):
    group = dist.group.WORLD if world > 1 else None
    report = {}
    for name, call in _paths(group, rank, world).items():
        call(1)  # the first call of the signature: the full agreement
        later = _Gemms()
        with _counting() as (collectives, reads), later:
            out = call(2)
        report[name] = (list(collectives), list(reads), bool(torch.isfinite(out).all()))
        if name.startswith("replay"):  # laid out from the host's sizes on every call: the first's ops and values
            agreement.forget_signatures()
            first = _Gemms()
            with first:
                out_first = call(2)
            report[name] += (bool(torch.equal(out, out_first)), (later.count, first.count))
    return report


EXPECTED_COLLECTIVES = {"forward_only": 1, "logprobs": 2, "logprobs_entropy": 2, "cross_entropy": 2, "grpo": 2,
                        "replay_forward_only": 1, "replay_logprobs_sparse": 2, "replay_logprobs_dense": 2,
                        "replay_grpo": 2, "replay_every_forward_only": 1, "replay_every_logprobs_sparse": 2,
                        "replay_every_logprobs_dense": 2}


@pytest.mark.parametrize("tp", [1, 2])
def test_second_call_makes_no_host_read_and_only_the_maths_collectives(tp):
    """A later call of a signature reads nothing back and makes only the math's collectives at
    TP = 2: the statistics' one all-gather (the rank check riding on it), and with gradients dX's
    sum (EXPECTED_COLLECTIVES). (Before: every call made the agreement's all-reduce and read-back,
    and GRPO its loss inputs' too; the merge was an all-reduce MAX and an all-reduce SUM.)"""
    for rank, report in enumerate(run_workers(_steady_worker, tp)):
        for name, (collectives, reads, finite, *replayed) in report.items():
            assert reads == [], (rank, name, reads)
            assert finite, (rank, name)
            if replayed:
                # a later call makes the first call's GEMMs (no plain pass where every labelled
                # row has a set) and its values, bit for bit
                same_values, (later_gemms, first_gemms) = replayed
                assert same_values, (rank, name)
                assert later_gemms == first_gemms, (rank, name, later_gemms, first_gemms)
            expected = EXPECTED_COLLECTIVES[name] if tp > 1 else 0
            assert len(collectives) == expected, (rank, name, collectives)


def _deferred_worker(rank, world, what, differentiable):
    group = dist.group.WORLD
    v = 40
    h, w, y = _inputs(5)
    w = w[rank * v:(rank + 1) * v]
    if differentiable:  # log-probs of one chunk: dlogits made in the forward, the poison in its launch
        h.requires_grad_()
    report = {}
    linear_logprobs(h, w, y, tp_group=group, vocab_size=75)  # the signature, agreed
    bad = y.clone()
    if what == "out_of_range":
        bad[1, 2] = 75
    elif rank == 1:  # labels that differ on one rank only
        bad[1, 2] = (bad[1, 2] + 1) % 75
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = linear_logprobs(h, w, bad, tp_group=group, vocab_size=75).logprobs
    report["all_nan"] = bool(torch.isnan(out).all())
    try:
        check_deferred_errors()
        report["raised"] = None
    except ValueError as error:
        report["raised"] = str(error)
    # the flags were read: the next checked call is clean, and a new signature agrees as before
    check_deferred_errors()
    report["next"] = bool(torch.isfinite(linear_logprobs(h, w, y, tp_group=group, vocab_size=75).logprobs).all())
    return report


@pytest.mark.parametrize("differentiable", [False, True], ids=["forward_only", "fwd_bwd"])
@pytest.mark.parametrize("what", ["out_of_range", "ranks_differ"])
def test_contents_found_bad_on_the_device_give_nan_and_raise_on_every_rank(what, differentiable):
    expected = "outside [0, vocab_size)" if what == "out_of_range" else "differ across tensor-parallel ranks"
    for rank, report in enumerate(run_workers(_deferred_worker, 2, what, differentiable)):
        assert report["all_nan"], rank
        assert report["raised"] is not None and expected in report["raised"], (rank, report["raised"])
        assert report["next"], rank


def _steady_call_report(call):
    """Run a steady call (no warning allowed): whether its results are all NaN and what the next
    check raised (None: nothing); the check after that is clean."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = call()
    report = {"all_nan": bool(torch.isnan(out).all())}
    try:
        check_deferred_errors()
        report["raised"] = None
    except ValueError as error:
        report["raised"] = str(error)
    check_deferred_errors()  # read: the next call is clean
    return report


def _bad_mask_worker(rank, world, what):
    group = dist.group.WORLD
    h, w, y = _inputs(12)
    w = w[rank * 40:(rank + 1) * 40]
    common = dict(tp_group=group, vocab_size=75)
    linear_logprobs(h, w, y, **common, sampling_mask=_sampling_mask(y, 12))  # the signature, agreed
    ids, offsets = _sampling_mask(y, 13)
    ids = ids.clone()
    if what == "duplicate":
        ids[1] = ids[0]  # an id twice in the first set
    elif what == "out_of_range":
        ids[4] = 75
    elif what == "sizes_differ":
        if rank == 1:  # one id fewer on one rank only: the same signature, another mask
            ids, offsets = _fewer_ids((ids, offsets), 3)
    elif rank == 1:  # a mask that differs on one rank only (still a valid mask there)
        ids[2] = (ids[2] + 1) % 75
    report = _steady_call_report(lambda: linear_logprobs(h, w, y, **common, sampling_mask=(ids, offsets)).logprobs)
    out = linear_logprobs(h, w, y, **common, sampling_mask=_sampling_mask(y, 14)).logprobs
    report["next"] = bool(torch.isfinite(out[:, 1:]).all())
    return report


@pytest.mark.parametrize("what", ["duplicate", "out_of_range", "ranks_differ", "sizes_differ"])
def test_a_bad_sampling_mask_in_a_steady_call_gives_nan_and_raises_on_every_rank(what):
    """Before: a call with a mask ran the full agreement on every call (its host read and
    all-reduce); now a steady call checks the mask on the device. A mask keeping fewer ids on one
    rank (its count of ids is not in the signature) is caught by the mask's fingerprint, no
    hang: no collective depends on that count."""
    expected = ("differ across tensor-parallel ranks" if what in ("ranks_differ", "sizes_differ")
                else "a bad sampling_mask")
    for rank, report in enumerate(run_workers(_bad_mask_worker, 2, what)):
        assert report["all_nan"], rank
        assert report["raised"] is not None and expected in report["raised"], (rank, report["raised"])
        assert report["next"], rank


def _fewer_ids(mask, position):
    """The mask with the last id of `position`'s set dropped (its label, the set's first id, kept):
    one id fewer in all, the same positions."""
    ids, offsets = mask
    end = int(offsets[position + 1])
    offsets = offsets.clone()
    offsets[position + 1:] -= 1
    return torch.cat([ids[:end - 1], ids[end:]]), offsets


def _kept_count_worker(rank, world):
    group = dist.group.WORLD if world > 1 else None
    h, w_full, y = _inputs(41)
    w_shard = w_full[rank * 40:(rank + 1) * 40] if world > 1 else w_full
    common = dict(tp_group=group, vocab_size=75)

    def call(mask):
        hh, ww = h.clone().requires_grad_(), w_shard.clone().requires_grad_()
        out = linear_logprobs(hh, ww, y, **common, return_entropy=True, sampling_mask=mask)
        (out.logprobs.sum() + out.entropy.sum()).backward()
        return torch.cat([out.logprobs.detach().reshape(-1), hh.grad.reshape(-1), ww.grad.reshape(-1)])

    call(_sampling_mask(y, 41, k=3, every=True))  # the signature's first call: 3 ids at each labelled position
    report = []
    for mask in (_sampling_mask(y, 42, k=5, every=True), _fewer_ids(_sampling_mask(y, 43, k=3, every=True), 8)):
        with _counting() as (collectives, reads):
            out = call(mask)
        agreement.forget_signatures()
        first = call(mask)  # the same mask as a signature's first call (its full agreement)
        lp = out[:y.numel()].reshape(y.shape).double()
        error = (lp - _reference_logprobs(h, w_full, y, mask)).abs().max().item()
        report.append((len(collectives), list(reads), bool(torch.equal(out, first)), error))
    return report


@pytest.mark.parametrize("tp", [1, 2])
def test_a_mask_keeping_more_or_fewer_ids_needs_no_new_agreement(tp):
    """A sampler's kept sets change size from step to step (top-p, min-p, how many tokens were
    generated): how many ids a mask keeps is not part of the call's signature, so a later call with
    more or fewer ids reads nothing back and makes only the math's collectives, with the values, dX
    and dW of a signature's first call, bit for bit. (Before: a new count of ids was a new
    signature, and every such call ran the full agreement, a host synchronization.)"""
    for rank, report in enumerate(run_workers(_kept_count_worker, tp)):
        for collectives, reads, same_as_first, error in report:
            assert reads == [], (rank, reads)
            assert collectives == (EXPECTED_COLLECTIVES["replay_every_logprobs_sparse"] if tp > 1 else 0), rank
            assert same_as_first, rank
            assert error < 1e-5, (rank, error)


def _reference_logprobs(h, w, y, mask):
    """float64 log-probs over each position's kept set (the whole vocab where it is empty), 0.0
    where the label is ignored."""
    z = (h.reshape(-1, h.shape[-1]).double() @ w.double().t())[:, :75]
    keep = keep_matrix(mask, z.shape[0], 75)
    labels = y.reshape(-1)
    lse = torch.logsumexp(z.masked_fill(~keep, float("-inf")), 1)
    safe = labels.clamp(min=0)
    lp = torch.where(keep.gather(1, safe[:, None])[:, 0], z.gather(1, safe[:, None])[:, 0] - lse, float("-inf"))
    return torch.where(labels == -100, 0.0, lp).reshape(y.shape)


def _moved_set(mask, row, width=6):
    """The same sizes (E, positions): position (row, 1), labelled, hands its set to (row, 0), ignored."""
    ids, offsets = mask
    offsets = offsets.clone()
    offsets[row * width + 1] = offsets[row * width + 2]
    return ids, offsets


def _missing_set_worker(rank, world):
    group = dist.group.WORLD if world > 1 else None
    h, w_full, y = _inputs(21)
    w = w_full[rank * 40:(rank + 1) * 40] if world > 1 else w_full
    common = dict(tp_group=group, vocab_size=75)
    # the signature's first call: a set at every labelled position (no plain pass, then or later)
    linear_logprobs(h, w, y, **common, sampling_mask=_sampling_mask(y, 21, every=True))
    mask = _moved_set(_sampling_mask(y, 22, every=True), row=1)  # the same sizes, (1, 1) now without a set
    report = _steady_call_report(lambda: linear_logprobs(h, w, y, **common, sampling_mask=mask).logprobs)
    agreement.forget_signatures()  # this call is the signature's first: it has the plain pass
    out = linear_logprobs(h, w, y, **common, sampling_mask=mask).logprobs
    report["after_forgetting"] = (out.double() - _reference_logprobs(h, w_full, y, mask)).abs().nan_to_num().max().item()
    report["finite"] = bool(torch.isfinite(out).all())
    return report


@pytest.mark.parametrize("tp", [1, 2])
def test_a_labelled_row_without_a_set_after_a_first_call_with_none_gives_nan_and_raises(tp):
    """Before: every later call of a mask's signature ran the plain pass over every row besides
    the kept sets (plain + replay in the steady state); now only where the first call needed it,
    and a later call that would need it where the first did not is caught, not silently wrong."""
    for rank, report in enumerate(run_workers(_missing_set_worker, tp)):
        assert report["all_nan"], rank
        assert report["raised"] is not None and "labelled position without a kept set" in report["raised"], (
            rank, report["raised"])
        assert "forget_signatures()" in report["raised"], report["raised"]
        assert report["finite"] and report["after_forgetting"] < 1e-5, (rank, report)


def _empty_set_first_worker(rank, world):
    group = dist.group.WORLD if world > 1 else None
    common = dict(tp_group=group, vocab_size=75)
    report = []
    for seed, moved in ((31, None), (32, None), (33, 2)):  # first call, later calls (another partition)
        h, w_full, y = _inputs(seed)
        w = w_full[rank * 40:(rank + 1) * 40] if world > 1 else w_full
        mask = _sampling_mask(y, seed)  # column 1 labelled, without a set
        if moved is not None:  # the same sizes: (2, 1) without a set, (2, 2) too
            ids, offsets = mask
            offsets = offsets.clone()
            offsets[moved * 6 + 2] = offsets[moved * 6 + 3]
            mask = (ids, offsets)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = linear_logprobs(h, w, y, **common, sampling_mask=mask).logprobs
        ref = _reference_logprobs(h, w_full, y, mask)
        report.append((bool(torch.equal(torch.isinf(out), torch.isinf(ref))),
                       (out.double() - ref).nan_to_num(posinf=0.0, neginf=0.0).abs().max().item()))
    check_deferred_errors()  # nothing was found
    return report


@pytest.mark.parametrize("tp", [1, 2])
def test_a_first_call_with_rows_without_a_set_keeps_the_plain_pass_in_later_calls(tp):
    for rank, report in enumerate(run_workers(_empty_set_first_worker, tp)):
        for call, (same_infinities, error) in enumerate(report):
            assert same_infinities and error < 1e-5, (rank, call, error)


def _grpo_inputs_differ_worker(rank, world):
    group = dist.group.WORLD
    paths = _paths(group, rank, world)
    paths["grpo"](1)
    h, w, y = _inputs(7)
    h, w = h.requires_grad_(), w[rank * 40:(rank + 1) * 40].clone().requires_grad_()  # the same signature
    g = torch.Generator().manual_seed(8)
    adv = torch.randn(4, generator=g)
    if rank == 1:
        adv[2] += 1.0  # another advantage on one rank only: dX parts of unrelated losses would be summed
    old = -torch.rand(y.shape, generator=g) * 3
    loss, _ = linear_grpo_loss(h, w, y.clamp(min=0), adv, (y != -100).float(), GRPO_EVERY_OPTION,
                               old_logprobs=old, reference_logprobs=old - 0.1, sampling_logprobs=old + 0.05,
                               tp_group=group, vocab_size=75)
    try:
        check_deferred_errors()
        raised = None
    except ValueError as error:
        raised = str(error)
    return bool(torch.isnan(loss)), raised


def test_grpo_inputs_that_differ_across_ranks_are_caught_in_steady_state():
    for nan, raised in run_workers(_grpo_inputs_differ_worker, 2):
        assert nan
        assert raised is not None and "differ across tensor-parallel ranks" in raised


def _number_normalizer_worker(rank, world):
    group = dist.group.WORLD if world > 1 else None
    h, w, y = _inputs(17)
    w = w[rank * 40:(rank + 1) * 40] if world > 1 else w
    g = torch.Generator().manual_seed(18)
    adv, old = torch.randn(4, generator=g), -torch.rand(y.shape, generator=g) * 3
    mask = (y != -100).float()

    def call(normalizer):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss, _ = linear_grpo_loss(hh, ww, y.clamp(min=0), adv, mask, GRPOConfig(), old_logprobs=old,
                                   normalizer=normalizer, tp_group=group, vocab_size=75)
        loss.backward()
        return torch.cat([loss.detach().reshape(1), hh.grad.reshape(-1), ww.grad.reshape(-1)])

    call(40.0)  # the signature's first call
    report = []
    for normalizer in (41.0, 43.5, 47.0):  # the general path of a remembered signature, then its route
        with _counting() as (collectives, reads):
            out = call(normalizer)
        report.append((len(collectives), list(reads), out))
    agreement.forget_signatures()
    firsts = [call(n) for n in (41.0, 43.5, 47.0)]  # each as a signature's first call
    same = [bool(torch.equal(out, first)) for (_, _, out), first in zip(report, firsts)]
    call(40.0)
    call(41.0)  # (the route recorded)
    # a bad number on the route, which skips the entry point's checks: NaN and an error, not a loss
    # scaled by it (on every rank alike)
    bad = _steady_call_report(lambda: call(-2.0)[:1])
    differ = None
    if world > 1:  # a later call whose normalizer differs on one rank: NaN and an error on every rank
        differ = _steady_call_report(lambda: call(42.0 if rank == 0 else 42.5)[:1])
    return [(n, r) for n, r, _ in report], same, bad, differ


@pytest.mark.parametrize("tp", [1, 2])
def test_a_number_normalizer_that_changes_needs_no_new_agreement(tp):
    """GRPO's `normalizer` given as a number (a global token count) changes from step to step: its
    value is compared across ranks, not part of the signature, so a later call with another value
    reads nothing back and makes only the math's collectives, with the loss, dX and dW of a
    signature's first call, bit for bit; a value that differs across ranks is caught by the rank
    check. (Before: every new value was a new signature, and its call ran the full agreement, a
    host synchronization.)"""
    for rank, (calls, same, bad, differ) in enumerate(run_workers(_number_normalizer_worker, tp)):
        for collectives, reads in calls:
            assert reads == [], (rank, reads)
            assert collectives == (EXPECTED_COLLECTIVES["grpo"] if tp > 1 else 0), rank
        assert all(same), (rank, same)
        assert bad["all_nan"] and "normalizer" in (bad["raised"] or ""), (rank, bad)
        if tp > 1:
            assert differ["all_nan"], rank
            assert differ["raised"] is not None and "differ across tensor-parallel ranks" in differ["raised"], differ


def test_a_gpu_normalizer_is_checked_on_the_device(monkeypatch):
    """GRPO's normalizer given as a GPU tensor (a global token count from an all-reduce) is not read
    on the host (one synchronization per call, on the general path; none at all on the remembered
    route, which skipped the checks): later calls read nothing back, and a bad value there gives a
    NaN loss and the error at the next check. (A CPU tensor is read on the host, where that costs
    nothing; here the CPU stands for the GPU.)"""
    from megatron_fused_ce.losses import nll

    monkeypatch.setattr(nll, "read_on_host", lambda count: False)
    h, w, y = _inputs(23)
    g = torch.Generator().manual_seed(24)
    adv, old = torch.randn(4, generator=g), -torch.rand(y.shape, generator=g) * 3
    mask = (y != -100).float()

    def call(normalizer):
        loss, _ = linear_grpo_loss(h.clone().requires_grad_(), w.clone().requires_grad_(), y.clamp(min=0), adv, mask,
                                   GRPOConfig(), old_logprobs=old, normalizer=normalizer, vocab_size=75)
        loss.backward()
        return loss.detach()

    call(torch.tensor(20.0))  # the signature's first call
    for normalizer in (torch.tensor(21.0), torch.tensor(22.0)):  # the general path, then the route
        with _counting() as (_, reads):
            loss = call(normalizer)
        assert reads == [] and torch.isfinite(loss), (normalizer, reads)
    check_deferred_errors()  # nothing found
    for bad in (torch.tensor(0.0), torch.tensor(-3.0), torch.tensor(float("nan"))):
        report = _steady_call_report(lambda: call(bad).reshape(1))
        assert report["all_nan"] and "normalizer" in (report["raised"] or ""), (bad, report)


def test_forget_signatures_brings_back_the_full_agreement():
    h, w, y = _inputs(9)
    linear_logprobs(h, w, y)
    with _counting() as (_, reads):
        linear_logprobs(h, w, y)
    assert reads == []
    agreement.forget_signatures()
    with _counting() as (_, reads):
        linear_logprobs(h, w, y)
    assert reads  # the agreement read its verdict back


def test_a_repeated_call_skips_the_agreement_and_a_changed_argument_is_checked_again(monkeypatch):
    """From the third call of a signature on, a call whose raw arguments (types, values, tensor
    layouts) repeat a remembered call's builds no agreement at all (api._REMEMBERED_CALLS); an
    argument that compares equal but has another type (chunk_size=True after 1) is not that call:
    it is checked, and refused."""
    from megatron_fused_ce.ops import api

    h, w, y = _inputs(10)
    for _ in range(2):
        linear_logprobs(h, w, y, chunk_size=1)
    built = []
    original_init = api.Agreement.__init__

    def counting_init(self, *args, **kwargs):
        built.append(args[0])
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(api.Agreement, "__init__", counting_init)
    expected = linear_logprobs(h, w, y, chunk_size=1).logprobs
    assert built == []
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        linear_logprobs(h, w, y, chunk_size=True)
    assert built == ["linear_logprobs"]
    agreement.forget_signatures()  # a forgotten signature is agreed again, not taken from the shortcut
    with _counting() as (_, reads):
        again = linear_logprobs(h, w, y, chunk_size=1).logprobs
    assert reads and built == ["linear_logprobs"] * 2
    assert torch.equal(again, expected)


def test_grpo_compiles_what_the_first_call_runs_and_nothing_more_later(monkeypatch):
    """GRPO's per-token terms and metrics are compiled on CUDA once per pattern of arguments
    (grpo.fused): the first call of a signature and the later ones must pass the same pattern
    (the results' poison is a tensor on both), else the second call compiles again, in the steady
    state (seconds of compilation; a failure there under torch.cuda.set_sync_debug_mode). The keys
    asked for are recorded here with compilation switched on and stubbed out (eager)."""
    from megatron_fused_ce.losses import grpo

    asked = []
    monkeypatch.setattr(grpo, "_fuses", lambda device: True)
    monkeypatch.setattr(grpo, "_compiled", lambda function, config, key: asked.append(key))
    h, w, y = _inputs(11)
    h.requires_grad_()
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(y.shape, generator=g) * 4
    keys = []
    for _ in range(3):
        asked.clear()
        loss, _ = linear_grpo_loss(h, w, y.clamp(min=0), torch.randn(4, generator=g), (y != -100).float(),
                                   GRPO_EVERY_OPTION, old_logprobs=old, reference_logprobs=old - 0.1,
                                   sampling_logprobs=old + 0.05)
        loss.backward()
        keys.append(set(asked))
    assert keys[0] and keys[0] == keys[1] == keys[2]


@pytest.mark.parametrize("path", ["cross_entropy", "logprobs", "forward_only", "grpo"])
def test_the_first_gemm_goes_before_the_label_kernel_and_is_made_once(monkeypatch, path):
    """At the row counts RL runs, an eager call spends about as long on the host as its first GEMM
    on the GPU: that GEMM is launched before the label kernel and the rest of the bookkeeping
    (fast.EarlyProduct), which then run while it computes, and the chunk loop takes it instead of
    making it again (one logits GEMM per chunk in the forward, three chunks here); like the loop's,
    it is not recorded by autograd."""
    from megatron_fused_ce.ops import api, fast

    h, w, y = _inputs(12)
    y = y.clamp(min=0) if path == "grpo" else y
    h.requires_grad_(path != "forward_only")
    calls = {
        "cross_entropy": lambda: linear_cross_entropy(h, w, y, chunk_size=10),
        "logprobs": lambda: linear_logprobs(h, w, y, chunk_size=10).logprobs.sum(),
        "forward_only": lambda: linear_logprobs(h, w, y, chunk_size=10).logprobs,
        "grpo": lambda: linear_grpo_loss(h, w, y, torch.ones(4), torch.ones(y.shape), GRPOConfig(),
                                         chunk_size=10)[0],
    }
    expected = calls[path]().detach()
    events = []
    logits_gemm, device_checks = fast.logits_gemm, api._DeviceChecks

    class RecordedChecks(device_checks):
        def __init__(self, *args, **kwargs):
            events.append("labels")
            super().__init__(*args, **kwargs)

    def recorded_gemm(*args):
        logits = logits_gemm(*args)
        events.append("gemm" if logits.grad_fn is None else "gemm recorded by autograd")
        return logits

    monkeypatch.setattr(fast, "logits_gemm", recorded_gemm)
    monkeypatch.setattr(api, "_DeviceChecks", RecordedChecks)
    assert torch.equal(calls[path]().detach(), expected)
    assert events == ["gemm", "labels", "gemm", "gemm"]


def _dx_sum_worker(rank, world, sequence_parallel):
    group = dist.group.WORLD
    h_full, w_full, y = _inputs(21)  # [s, b, H] with Megatron's layout; labels [s, b]
    v, s_local = w_full.shape[0] // world, h_full.shape[0] // world
    w = w_full[rank * v:(rank + 1) * v].clone().requires_grad_()
    h = (h_full[rank * s_local:(rank + 1) * s_local] if sequence_parallel else h_full).clone().requires_grad_()
    report = {}
    for upstream in (1e-5, 3.0):  # a loss scale as small as Megatron's, and one above 1
        h.grad = w.grad = None
        call = lambda: linear_cross_entropy(h, w, y, tp_group=group, vocab_size=75,
                                            sequence_parallel=sequence_parallel)
        call().detach()  # the signature's first call
        with _counting() as (forward_collectives, _):
            loss = call()
        with _counting() as (backward_collectives, _):
            (loss * upstream).backward()
        report[upstream] = (list(forward_collectives), list(backward_collectives), loss.detach(),
                            h.grad.clone(), w.grad.clone())
    return report


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_cross_entropy_sums_dx_over_ranks_in_its_forward(sequence_parallel):
    """Cross-entropy makes its gradients in the forward: dX's sum over TP ranks (all-reduce, or
    reduce-scatter under SP) starts there, beside the last dW GEMM, and the backward only scales
    (the upstream gradient applied after the sum). dX and dW stay those of the float64 reference
    at an upstream gradient of 1e-5 and of 3."""
    h_full, w_full, y = _inputs(21)
    h64 = h_full.double().requires_grad_()
    w64 = w_full.double().requires_grad_()
    logits = (h64 @ w64[:75].t()).reshape(-1, 75)  # (vocab 75 of the 80 padded rows)
    ref = torch.nn.functional.cross_entropy(logits, y.reshape(-1), ignore_index=-100)
    v, s_local = w_full.shape[0] // 2, h_full.shape[0] // 2
    for rank, report in enumerate(run_workers(_dx_sum_worker, 2, sequence_parallel)):
        for upstream, (forward, backward, loss, dx, dw) in report.items():
            # (under SP the forward first gathers the sequence): the merge's one all-gather, dX's sum
            gather = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
            assert forward == ([gather, gather, "reduce_scatter_tensor"] if sequence_parallel
                               else [gather, "all_reduce"]), (rank, forward)
            assert backward == [], (rank, backward)
            gh, gw = torch.autograd.grad(ref * upstream, (h64, w64), retain_graph=True)
            if sequence_parallel:
                gh = gh[rank * s_local:(rank + 1) * s_local]
            torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
            # fp32 against float64, relative to the largest gradient
            scale = gh.abs().max()
            torch.testing.assert_close(dx.double() / scale, gh / scale, rtol=0, atol=1e-5)
            torch.testing.assert_close(dw.double() / scale, gw[rank * v:(rank + 1) * v] / scale, rtol=0, atol=1e-5)
