"""A remembered signature's route run straight (ops/remembered_routes.py) gives what the general
path gives, bit for bit, and is taken only where the general path would take that route.

Without a GPU the Triton kernels run under Triton's interpreter (as in test_triton_backend.py),
with its launch settings shrunk so that the one-launch statistics apply to a few dozen rows."""

import math
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from route_checks import count_general_calls, routed_equals_general  # noqa: E402
from triton_interpret import kernel_modules  # noqa: E402
from megatron_fused_ce import linear_cross_entropy, linear_logprobs  # noqa: E402
import megatron_fused_ce.losses.linear_cross_entropy  # noqa: E402,F401
from megatron_fused_ce.ops import agreement, deferred_errors, remembered_routes  # noqa: E402

ce_module = sys.modules["megatron_fused_ce.losses.linear_cross_entropy"]  # (the package exports the function)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SMALL_BLOCKS = dict(STATS_BLOCK_N=64, DLOGITS_BLOCK_N=64, MERGE_BLOCK_R=4)


@pytest.fixture
def tb(monkeypatch):
    if DEVICE.type == "cuda":
        from megatron_fused_ce.ops.backends import triton_backend as module
    else:
        module = kernel_modules()["triton_backend"]
    for name, value in SMALL_BLOCKS.items():
        monkeypatch.setattr(module, name, value)
    agreement.forget_signatures()
    yield module
    agreement.forget_signatures()


@pytest.fixture
def general_calls(monkeypatch):
    """linear_cross_entropy's calls through the general path."""
    return count_general_calls(monkeypatch, ce_module)


@pytest.fixture
def general_logprob_calls(monkeypatch):
    """linear_logprobs' calls through the general path."""
    from megatron_fused_ce.ops import api

    return count_general_calls(monkeypatch, api)


def _inputs(tb, seed, hidden_shape=None, rows=None):
    if rows is None:
        rows = tb.PROGRAMS_PER_SM * tb._sm_count(DEVICE) + 5  # the one-launch statistics apply
    g = torch.Generator().manual_seed(seed)
    hdim, vocab, padded = 16, 140, 150
    h = torch.randn(rows, hdim, generator=g)
    w = torch.randn(padded, hdim, generator=g) / math.sqrt(hdim) * 3
    y = torch.randint(0, vocab, (rows,), generator=g)
    y[::4] = -100
    if hidden_shape is not None:
        h, y = h.reshape(*hidden_shape, hdim), y.reshape(hidden_shape)
    return h.to(DEVICE), w.to(DEVICE), y.to(DEVICE), vocab


def _call(h0, w0, y, vocab, reduction, grad=(True, True), upstream=(3.0,), **extra):
    h, w = h0.clone().requires_grad_(grad[0]), w0.clone().requires_grad_(grad[1])
    loss = linear_cross_entropy(h, w, y, vocab_size=vocab, temperature=0.7, impl="triton", reduction=reduction,
                                **extra)
    for i, g in enumerate(upstream):  # several: a second backward through the retained graph
        (loss * g).backward(retain_graph=i + 1 < len(upstream))
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", ["plain", "3-d hidden, int32 labels", "dX only", "dW only",
                                  "second backward, loss scale 1e-5", "fewer rows than one launch needs"])
def test_cross_entropy_route_equals_the_general_path(tb, general_calls, monkeypatch, reduction, case):
    """The third call of a signature (the second is the first remembered one, which records the
    route) skips the general path, and its loss, dX and dW are the general path's bit for bit —
    with ignored labels, a padded vocab, temperature, and whatever the upstream gradient; they
    also match a float64 reference. Where the one-launch statistics do not apply (fewer rows than
    they need) the route takes the stats and dlogits kernels, as the general path does."""
    h, w, y, vocab = _inputs(tb, 1, hidden_shape=(-1, 1) if case.startswith("3-d") else None,
                             rows=tb.PROGRAMS_PER_SM * tb._sm_count(DEVICE) - 4 if case.startswith("fewer") else None)
    if case.startswith("3-d"):
        y = y.int()
    kwargs = dict(grad={"dX only": (True, False), "dW only": (False, True)}.get(case, (True, True)),
                  upstream=(1e-5, 3.0) if case.startswith("second") else (3.0,))

    got = routed_equals_general(monkeypatch, lambda: _call(h, w, y, vocab, reduction, **kwargs), general_calls,
                                 ("loss", "dX", "dW"), case)
    assert next(reversed(remembered_routes._ROUTES.values())).one_launch == (not case.startswith("fewer"))

    # against float64: fp32 math on fp32 inputs (GEMMs of 16-wide rows, gradients times up to 3)
    h64, w64 = h.double().reshape(-1, h.shape[-1]).requires_grad_(), w.double().requires_grad_()
    logits = (h64 @ w64.T)[:, :vocab] / 0.7
    ref = torch.nn.functional.cross_entropy(logits, y.reshape(-1).long(), ignore_index=-100, reduction=reduction)
    ref.backward(torch.tensor(sum(kwargs["upstream"]), dtype=torch.float64))
    torch.testing.assert_close(got[0].double(), ref.detach(), rtol=1e-5, atol=1e-6)
    if got[1] is not None:
        torch.testing.assert_close(got[1].double().reshape(-1, h.shape[-1]), h64.grad, rtol=1e-4, atol=1e-5)
    if got[2] is not None:
        torch.testing.assert_close(got[2].double(), w64.grad, rtol=1e-4, atol=1e-5)


def test_cross_entropy_route_checks_the_labels_on_the_device(tb, general_calls):
    """A routed call with a label outside the vocab returns NaN and the error is raised at the next
    check (deferred_errors.py), as the general path's later calls do."""
    h, w, y, vocab = _inputs(tb, 2)
    for _ in range(3):
        _call(h, w, y, vocab, "mean")
    deferred_errors.check_deferred_errors()
    bad = y.clone()
    bad[1] = vocab + 3
    general_calls.clear()
    loss, dx, dw = _call(h, w, bad, vocab, "mean")
    assert not general_calls and loss.isnan()
    with pytest.raises(ValueError, match="labels outside"):
        deferred_errors.check_deferred_errors()


def test_cross_entropy_route_is_taken_only_where_the_general_path_takes_it(tb, general_calls, monkeypatch):
    """Dropped with its signature (forget_signatures); not taken with the one-launch statistics
    switched off, under saved-tensor hooks, or for arguments outside its key (other options,
    another shape, label smoothing); "none" takes the per-token route, but not with smoothing."""
    h, w, y, vocab = _inputs(tb, 3)
    for _ in range(3):
        _call(h, w, y, vocab, "mean")
    assert len(general_calls) == 2
    general_calls.clear()
    agreement.forget_signatures()
    _call(h, w, y, vocab, "mean")
    assert len(general_calls) == 1
    for _ in range(2):
        _call(h, w, y, vocab, "mean")
    assert len(general_calls) == 2  # recorded again by the signature's next call, then taken
    general_calls.clear()
    monkeypatch.setattr(tb, "STATS_DLOGITS", False)
    _call(h, w, y, vocab, "mean")
    monkeypatch.setattr(tb, "STATS_DLOGITS", True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        _call(h, w, y, vocab, "mean")
    assert len(general_calls) == 2
    for extra in (dict(label_smoothing=0.1), dict(chunk_size=16), dict(ignore_index=-1)):
        general_calls.clear()
        labels = y.masked_fill(y < 0, -1) if "ignore_index" in extra else y
        for _ in range(3):
            _call(h, w, labels, vocab, "mean", **extra)
        assert len(general_calls) == (3 if "label_smoothing" in extra or "chunk_size" in extra else 2), extra
    for extra, general in ((dict(), 2), (dict(label_smoothing=0.1), 3), (dict(z_loss_weight=1e-4), 3)):
        general_calls.clear()
        for _ in range(3):
            linear_cross_entropy(h, w.clone().requires_grad_(), y, vocab_size=vocab, temperature=0.7, impl="triton",
                                 reduction="none", **extra)
        assert len(general_calls) == general, extra



@pytest.mark.parametrize("case", ["forward-only", "forward-only 3-d", "fwd+bwd", "fwd+bwd dW only",
                                  "fwd+bwd second backward"])
def test_logprob_routes_equal_the_general_path(tb, general_logprob_calls, monkeypatch, case):
    """linear_logprobs of one chunk (no entropy, sampler or mask): the third call of a signature runs
    the route the second recorded, forward-only (reference / old-policy passes) or with its dlogits
    made in the forward, and its log-probs, dX and dW are the general path's bit for bit."""
    h0, w0, y, vocab = _inputs(tb, 4, hidden_shape=(-1, 1) if case.endswith("3-d") else None)
    upstream = torch.linspace(-1.0, 2.0, y.numel(), device=DEVICE).reshape(y.shape)

    def call():
        grad = not case.startswith("forward-only")
        h = h0.clone().requires_grad_(grad and "dW only" not in case)
        w = w0.clone().requires_grad_(grad)
        out = linear_logprobs(h, w, y, vocab_size=vocab, temperature=0.7, impl="triton")
        assert out.entropy is None
        if grad:
            for i, scale in enumerate((1e-5, 3.0) if "second" in case else (1.0,)):
                (out.logprobs * upstream * scale).sum().backward(retain_graph=i == 0 and "second" in case)
        return out.logprobs.detach(), h.grad, w.grad

    got = routed_equals_general(monkeypatch, call, general_logprob_calls, ("log-probs", "dX", "dW"), case)
    with torch.no_grad():  # the old-policy pass gives the training pass's log-probs (ratio 1)
        assert torch.equal(linear_logprobs(h0, w0, y, vocab_size=vocab, temperature=0.7, impl="triton").logprobs,
                           got[0])
    logits = (h0.double().reshape(-1, h0.shape[-1]) @ w0.double().T)[:, :vocab] / 0.7
    flat = y.reshape(-1)
    ref = torch.log_softmax(logits, -1).gather(1, flat.clamp(min=0)[:, None])[:, 0].where(flat >= 0, 0.0)
    torch.testing.assert_close(got[0].double().reshape(-1), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["forward-only", "fwd+bwd", "fwd+bwd 3-d", "fwd+bwd dW only",
                                  "fwd+bwd second backward"])
def test_per_token_cross_entropy_route_equals_the_general_path(tb, general_calls, monkeypatch, case):
    """linear_cross_entropy(reduction="none") without smoothing or z-loss (Megatron's output layer):
    the third call of a signature runs the log-prob route the second recorded, negated, and its
    losses, dX and dW are the general path's bit for bit (and -log p_y of float64)."""
    h0, w0, y, vocab = _inputs(tb, 6, hidden_shape=(-1, 1) if "3-d" in case else None)
    upstream = torch.linspace(-1.0, 2.0, y.numel(), device=DEVICE).reshape(y.shape)

    def call():
        grad = not case.startswith("forward-only")
        h = h0.clone().requires_grad_(grad and "dW only" not in case)
        w = w0.clone().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            loss = linear_cross_entropy(h, w, y, vocab_size=vocab, temperature=0.7, impl="triton", reduction="none")
        assert loss.shape == y.shape
        if grad:
            for i, scale in enumerate((1e-5, 3.0) if "second" in case else (1.0,)):
                (loss * upstream * scale).sum().backward(retain_graph=i == 0 and "second" in case)
        return loss.detach(), h.grad, w.grad

    got = routed_equals_general(monkeypatch, call, general_calls, ("losses", "dX", "dW"), case)
    logits = (h0.double().reshape(-1, h0.shape[-1]) @ w0.double().T)[:, :vocab] / 0.7
    flat = y.reshape(-1)
    ref = -torch.log_softmax(logits, -1).gather(1, flat.clamp(min=0)[:, None])[:, 0].where(flat >= 0, 0.0)
    torch.testing.assert_close(got[0].double().reshape(-1), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["one launch", "one launch, int32 labels of a 2-d batch", "above its bound"])
def test_forward_only_route_takes_one_launch_for_the_labels_and_log_probs(tb, general_logprob_calls, monkeypatch,
                                                                          case):
    """A routed forward-only call at TP = 1 (a reference or old-policy pass) of at most
    LABELS_IN_LAUNCH_MAX_ROWS rows takes the backend's one launch of label checks and log-probs
    (backends.LabelLogprob) where the general path launches the label kernel and the stats kernel:
    the same log-probs bit for bit; above the bound the route launches the two as well. A later
    call with a label outside the vocab: NaN in every row and the error at the next check."""
    from dataclasses import replace

    h, w, y, vocab = _inputs(tb, 7, hidden_shape=(3, -1) if "2-d" in case else None,
                             rows=3 * (tb.PROGRAMS_PER_SM * tb._sm_count(DEVICE) + 2))
    if "int32" in case:
        y = y.int()
    if case == "above its bound":
        monkeypatch.setattr(tb, "LABELS_IN_LAUNCH_MAX_ROWS", y.numel() - 1)
    runs = []

    def run(logits, *args):
        runs.append(logits.shape[0])
        return tb.label_logprob(logits, *args)

    monkeypatch.setattr(tb, "BACKEND", replace(tb.BACKEND, label_logprob=replace(tb.BACKEND.label_logprob, run=run)))

    def call(labels=y):
        with torch.no_grad():
            return (linear_logprobs(h, w, labels, vocab_size=vocab, temperature=0.7, impl="triton").logprobs,)

    got = routed_equals_general(monkeypatch, call, general_logprob_calls, ("log-probs",), case)[0]
    assert runs == ([] if case == "above its bound" else [y.numel()])
    assert got.shape == y.shape
    logits = (h.double().reshape(-1, h.shape[-1]) @ w.double().T)[:, :vocab] / 0.7
    flat = y.reshape(-1).long()
    ref = torch.log_softmax(logits, -1).gather(1, flat.clamp(min=0)[:, None])[:, 0].where(flat >= 0, 0.0)
    torch.testing.assert_close(got.double().reshape(-1), ref, rtol=1e-5, atol=1e-5)
    deferred_errors.check_deferred_errors()
    bad = y.clone()
    bad.view(-1)[5] = vocab + 3
    general_logprob_calls.clear()
    out = call(bad)[0]
    assert not general_logprob_calls and torch.isnan(out).all()
    with pytest.raises(ValueError, match="labels outside"):
        deferred_errors.check_deferred_errors()


@pytest.mark.parametrize("case", ["cross-entropy mean", "cross-entropy sum", "log-probs", "log-probs dW only",
                                  "cross-entropy mean above its bound"])
def test_routes_take_the_label_checks_in_their_launch_of_statistics_and_dlogits(tb, general_logprob_calls, general_calls,
                                                                                monkeypatch, case):
    """At TP = 1 a routed cross-entropy or log-probs call whose statistics and dlogits come from one
    launch, of at most LABELS_IN_LAUNCH_MAX_ROWS rows, takes the label checks in that launch
    (backends.LabelsInLaunch: a launch and its host work fewer than the label kernel's): loss or
    log-probs, dX and dW the general path's bit for bit, whatever the upstream gradient; above the
    bound the route launches the label kernel. A later call with a label outside the vocab: NaN
    and the error at the next check."""
    from dataclasses import replace

    h0, w0, y, vocab = _inputs(tb, 8)
    if case.endswith("above its bound"):
        monkeypatch.setattr(tb, "LABELS_IN_LAUNCH_MAX_ROWS", y.numel() - 1)
    runs, original = [], tb.BACKEND.stats_dlogits

    def run_(logits, *args, **kwargs):
        runs.append(kwargs)
        return original.with_labels.run_(logits, *args, **kwargs)

    monkeypatch.setattr(tb, "BACKEND", replace(tb.BACKEND, stats_dlogits=replace(
        original, with_labels=replace(original.with_labels, run_=run_))))
    upstream = torch.linspace(-1.0, 2.0, y.numel(), device=DEVICE)

    def call(labels=y):
        h = h0.clone().requires_grad_("dW only" not in case)
        w = w0.clone().requires_grad_()
        if case.startswith("log-probs"):
            out = linear_logprobs(h, w, labels, vocab_size=vocab, temperature=0.7, impl="triton").logprobs
            (out * upstream).sum().backward()
        else:
            out = linear_cross_entropy(h, w, labels, vocab_size=vocab, temperature=0.7, impl="triton",
                                       reduction=case.split()[1])
            (out * 1e-5).backward()
        return out.detach(), h.grad, w.grad

    general = general_logprob_calls if case.startswith("log-probs") else general_calls
    got = routed_equals_general(monkeypatch, call, general, ("output", "dX", "dW"), case)
    kind = (dict(logprob=True) if case.startswith("log-probs") else dict(mean=case.split()[1] == "mean"))
    assert runs == ([] if case.endswith("above its bound") else [kind]), runs
    if case.startswith("log-probs"):
        logits = (h0.double() @ w0.double().T)[:, :vocab] / 0.7
        ref = torch.log_softmax(logits, -1).gather(1, y.clamp(min=0)[:, None])[:, 0].where(y >= 0, 0.0)
        torch.testing.assert_close(got[0].double(), ref, rtol=1e-5, atol=1e-5)
    deferred_errors.check_deferred_errors()
    bad = y.clone()
    bad[3] = vocab + 3
    general.clear()
    out = call(bad)[0]
    assert not general and torch.isnan(out).all()
    with pytest.raises(ValueError, match="labels outside"):
        deferred_errors.check_deferred_errors()


def test_logprob_routes_are_not_taken_for_other_arguments(tb, general_logprob_calls):
    """Entropy (without a sampling mask), a sampler setting, or several chunks keep the general path."""
    h, w, y, vocab = _inputs(tb, 5)
    for extra in (dict(return_entropy=True), dict(top_k=5), dict(chunk_size=16)):
        general_logprob_calls.clear()
        for _ in range(3):
            with torch.no_grad():
                linear_logprobs(h, w, y, vocab_size=vocab, impl="triton", **extra)
        assert len(general_logprob_calls) == 3, extra


def test_options_given_as_tensors_keep_the_general_path(tb, general_calls, general_logprob_calls):
    """An option given as a 0-d tensor (vocab_size, return_entropy) is held by a key by identity,
    not by value: changed in place between calls, a route recorded for the old value would run
    (the loss over the old vocab, no entropy). Every such call takes the general path, which reads
    the values."""
    h, w, y, vocab = _inputs(tb, 8)
    y = torch.where(y >= 100, -100, y)  # labels below both vocab sizes
    vocab_size = torch.tensor(vocab)
    for _ in range(3):
        _call(h, w, y, vocab_size, "mean")
    vocab_size.fill_(100)
    loss, dx, dw = _call(h, w, y, vocab_size, "mean")
    expected = _call(h, w, y, 100, "mean")
    assert torch.equal(loss, expected[0]) and torch.equal(dx, expected[1]) and torch.equal(dw, expected[2])
    assert len(general_calls) == 5

    wants_entropy = torch.tensor(False)
    for _ in range(3):
        with torch.no_grad():
            assert linear_logprobs(h, w, y, vocab_size=vocab, impl="triton", return_entropy=wants_entropy).entropy is None
    wants_entropy.fill_(True)
    with torch.no_grad():
        out = linear_logprobs(h, w, y, vocab_size=vocab, impl="triton", return_entropy=wants_entropy)
        expected = linear_logprobs(h, w, y, vocab_size=vocab, impl="triton", return_entropy=True)
    assert out.entropy is not None and torch.equal(out.entropy, expected.entropy)


@pytest.mark.parametrize("path", ["cross-entropy", "log-probs", "grpo"])
def test_inputs_changed_in_place_before_the_backward_are_refused_on_every_call(tb, path):
    """hidden or weight changed in place between a call's forward and its backward: autograd's
    error on every call of a signature, the routed ones too (a route's node makes its gradients
    in the forward: without autograd's version check on its saved inputs it handed them back,
    the gradients at the old values, where the general path raises)."""
    from megatron_fused_ce.losses import GRPOConfig, linear_grpo_loss

    h0, w0, y, vocab = _inputs(tb, 9)

    def forward(h, w):
        if path == "cross-entropy":
            return linear_cross_entropy(h, w, y, vocab_size=vocab, impl="triton")
        if path == "log-probs":
            return linear_logprobs(h, w, y, vocab_size=vocab, impl="triton").logprobs.sum()
        mask = (y >= 0).float()
        return linear_grpo_loss(h[None], w, y[None], torch.ones(1, device=DEVICE), mask[None], GRPOConfig(),
                                vocab_size=vocab, old_logprobs=torch.full_like(mask[None], -4.0), impl="triton")[0]

    for changed in [None, None, None, "hidden", "weight", None]:
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        hidden, weight = h.clone(), w.clone()  # non-leaf inputs, changed in place below
        loss = forward(hidden, weight)
        if changed is None:
            loss.backward()
            continue
        with torch.no_grad():
            (hidden if changed == "hidden" else weight).mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_results_do_not_depend_on_the_default_dtype(tb, impl):
    """torch.set_default_dtype(torch.bfloat16), common around a model's construction, changes
    nothing: every call (the general path's two, then the route) gives the bits it gives under
    float32. (A mean's 1 / count came from an integer's reciprocal, which takes the default dtype:
    rounded to bf16, the loss, dX and dW were 2e-3 off with 19 labelled tokens.)"""
    from megatron_fused_ce.losses import GRPOConfig, linear_grpo_loss

    h, w, y, vocab = _inputs(tb, 9, hidden_shape=(2, 13), rows=26)
    advantages, mask = torch.tensor([0.7, -1.2], device=DEVICE), torch.ones(2, 13, device=DEVICE)

    def calls():
        results = []
        for _ in range(3):
            for reduction in ("mean", "sum"):
                hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
                loss = linear_cross_entropy(hh, ww, y, vocab_size=vocab, temperature=0.7, impl=impl, reduction=reduction)
                results += [loss.detach(), *torch.autograd.grad(loss, (hh, ww))]
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            out = linear_logprobs(hh, ww, y, vocab_size=vocab, impl=impl)
            results += [out.logprobs.detach(), *torch.autograd.grad(out.logprobs.sum(), (hh, ww))]
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            loss, metrics = linear_grpo_loss(hh, ww, y, advantages, mask, GRPOConfig(beta=0.1), vocab_size=vocab,
                                             impl=impl, old_logprobs=torch.full((2, 13), -5.0, device=DEVICE),
                                             reference_logprobs=torch.full((2, 13), -4.0, device=DEVICE))
            results += [loss.detach(), *torch.autograd.grad(loss, (hh, ww)), *metrics.values()]
        return results

    expected = calls()
    agreement.forget_signatures()
    torch.set_default_dtype(torch.bfloat16)
    try:
        got = calls()
    finally:
        torch.set_default_dtype(torch.float32)
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert a.dtype == b.dtype and torch.equal(a, b), i


def _kept_sets(labels, vocab, seed, sizes, without_set=()):
    """(token_ids, offsets): at each position a set of sizes[i % len(sizes)] ids holding the label
    at two of every three labelled positions (the others' log-probs are -inf); no set at the
    positions `without_set`."""
    g = torch.Generator().manual_seed(seed)
    sets = []
    for i, label in enumerate(labels.reshape(-1).tolist()):
        ids = torch.randperm(vocab, generator=g)[:0 if i in without_set else sizes[i % len(sizes)]]
        if label >= 0 and i % 3 and ids.numel() and not bool((ids == label).any()):
            ids[0] = label
        sets.append(ids)
    offsets = torch.tensor([0] + [t.numel() for t in sets]).cumsum(0)
    return torch.cat(sets).to(DEVICE), offsets.to(DEVICE)


@pytest.mark.parametrize("case", ["by sizes", "tiles", "dense", "sparse", "forward-only", "dW only",
                                  "a labelled row without a set", "entropy", "entropy, its gradient only",
                                  "entropy, forward-only"])
def test_replay_route_equals_the_general_path(tb, general_logprob_calls, monkeypatch, case):
    """linear_logprobs with a sampling mask: the third call of a signature runs the route the
    second recorded, its mask keeping another number of ids than the calls before (as a sampler's
    do, step to step), on the pieces its sizes choose (or those forced), and its log-probs (and
    entropy), dX and dW are the general path's bit for bit, whichever results the loss uses; with
    the plain pass where the signature's first call had a labelled row without a set. The
    log-probs match a float64 reference over the kept sets (-inf where the label is not kept)."""
    from megatron_fused_ce.ops import replay

    if case in ("tiles", "dense", "sparse"):
        monkeypatch.setattr(replay, "FORCE_PIECES", case)
    h0, w0, y, vocab = _inputs(tb, 6, rows=40)
    missing = (1,) if case.startswith("a labelled row") else ()
    assert y[1] >= 0
    masks = [_kept_sets(y, vocab, seed, sizes, missing) for seed, sizes in ((1, (2, 5)), (2, (3, 7, 1)), (3, (4,)))]
    upstream = torch.linspace(-1.0, 2.0, y.numel(), device=DEVICE)
    calls = []

    def call():
        mask = masks[len(calls) % 3]
        calls.append(1)
        grad = not case.endswith("forward-only")
        entropy = case.startswith("entropy")
        h, w = h0.clone().requires_grad_(grad and case != "dW only"), w0.clone().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            out = linear_logprobs(h, w, y, vocab_size=vocab, temperature=0.7, impl="triton", sampling_mask=mask,
                                  return_entropy=entropy)
        assert (out.entropy is not None) == entropy
        if grad:
            kept = torch.where(out.logprobs.isfinite(), out.logprobs, 0.0)
            loss = 0.0 if case == "entropy, its gradient only" else (kept * upstream).sum()
            if entropy:
                loss = loss + (out.entropy * upstream.flip(0)).sum()
            loss.backward()
        return out.logprobs.detach(), h.grad, w.grad, None if out.entropy is None else out.entropy.detach()

    got = routed_equals_general(monkeypatch, call, general_logprob_calls, ("log-probs", "dX", "dW", "entropy"),
                                 case)
    route = next(reversed(remembered_routes._ROUTES.values()))
    assert type(route).__name__ == "ReplayRoute" and route.plain_pass == bool(missing)
    ids, offsets = (t.cpu() for t in masks[2])
    z = (h0.double() @ w0.double().T)[:, :vocab].cpu() / 0.7
    ref = torch.zeros(y.numel(), dtype=torch.float64)
    for i, label in enumerate(y.tolist()):
        kept = ids[offsets[i]:offsets[i + 1]]
        if label < 0:
            continue
        if kept.numel() == 0:
            ref[i] = torch.log_softmax(z[i], 0)[label]
        else:
            ref[i] = z[i, label] - torch.logsumexp(z[i, kept], 0) if bool((kept == label).any()) else float("-inf")
    torch.testing.assert_close(got[0].double().cpu(), ref, rtol=1e-5, atol=1e-5)
    deferred_errors.check_deferred_errors()


def test_replay_route_checks_the_mask_on_the_device(tb, general_logprob_calls):
    """A routed replay call whose mask lists an id twice at a position, or whose labels hold one
    outside [0, vocab) (checked by the layout's launch where no plain pass runs): its log-probs are
    NaN and the error is raised at the next check, as the general path's later calls do; a mask
    keeping no id takes the general path (nothing to replay)."""
    h0, w0, y, vocab = _inputs(tb, 7, rows=24)
    ids, offsets = _kept_sets(y, vocab, 4, (3, 5))

    def call(mask, labels=y):
        h = h0.clone().requires_grad_()
        out = linear_logprobs(h, w0, labels, vocab_size=vocab, impl="triton", sampling_mask=mask)
        torch.where(out.logprobs.isfinite(), out.logprobs, 0.0).sum().backward()
        return out.logprobs.detach()

    for _ in range(3):
        call((ids, offsets))
    assert len(general_logprob_calls) == 2
    deferred_errors.check_deferred_errors()
    bad = ids.clone()
    bad[1] = bad[0]  # (the first set holds at least 3 ids)
    general_logprob_calls.clear()
    assert call((bad, offsets)).isnan().all() and not general_logprob_calls
    with pytest.raises(ValueError, match="listed twice|sampling_mask"):
        deferred_errors.check_deferred_errors()
    for label in (vocab, -3):
        out_of_range = y.clone()
        # (a labelled position; its set stays as it was)
        out_of_range.view(-1)[int((y.view(-1) != -100).nonzero()[0])] = label
        assert call((ids, offsets), out_of_range).isnan().all() and not general_logprob_calls
        with pytest.raises(ValueError, match="labels outside"):
            deferred_errors.check_deferred_errors()
    call((ids, offsets))
    deferred_errors.check_deferred_errors()
    general_logprob_calls.clear()
    call((ids[:0], torch.zeros_like(offsets)))
    assert len(general_logprob_calls) == 1


@pytest.fixture
def general_grpo_calls(monkeypatch):
    """linear_grpo_loss' calls through the general path."""
    return count_general_calls(monkeypatch, sys.modules["megatron_fused_ce.losses.linear_grpo"])


@pytest.mark.parametrize("case", ["grpo", "dapo, old and reference log-probs, KL", "sequence-first, normalizer",
                                  "dW only", "second backward, loss scale 1e-5", "torch backend"])
def test_grpo_route_equals_the_general_path(tb, general_grpo_calls, monkeypatch, case):
    """linear_grpo_loss of one chunk at TP = 1: the third call of a signature runs the route the
    second recorded (the label kernel with the loss's mask, the statistics, the call's own GRPOGrads
    and the dlogits in one lean node), and its loss, metrics, dX and dW are the general path's bit
    for bit, whatever the upstream gradient (a second backward through the retained graph too), on
    the Triton backend (the per-token kernel writes the loss) and on torch's (its definition)."""
    from megatron_fused_ce.losses import GRPOConfig, linear_grpo_loss

    g = torch.Generator().manual_seed(6)
    batch, length, hdim, vocab = 4, 10, 16, 140
    h0 = torch.randn(batch, length, hdim, generator=g).to(DEVICE)
    w0 = (torch.randn(150, hdim, generator=g) / math.sqrt(hdim) * 3).to(DEVICE)
    y = torch.randint(0, vocab, (batch, length), generator=g).to(DEVICE)
    mask = (torch.rand(batch, length, generator=g) > 0.2).float().to(DEVICE)
    advantages = torch.randn(batch, generator=g).to(DEVICE)
    lp = -torch.rand(batch, length, generator=g).to(DEVICE) * 4
    first = case.startswith("sequence-first")
    config = GRPOConfig(loss_type="dapo", beta=0.05) if case.startswith("dapo") else GRPOConfig()
    extra = dict(old_logprobs=lp + 0.1, reference_logprobs=lp - 0.2) if case.startswith("dapo") else {}
    if first:
        extra = dict(sequence_parallel=True, normalizer=17.0, old_logprobs=lp)

    def call():
        h = (h0.transpose(0, 1).contiguous() if first else h0).clone().requires_grad_("dW only" not in case)
        w = w0.clone().requires_grad_()
        loss, metrics = linear_grpo_loss(h, w, y.t() if first else y, advantages, mask, config, vocab_size=vocab,
                                         temperature=0.7, impl="torch" if case.startswith("torch") else "triton",
                                         **extra)
        loss.add_(0.0)  # (the loss may be changed in place, as the general path's)
        scales = (1e-5, 3.0) if case.startswith("second") else (3.0,)
        for i, scale in enumerate(scales):
            (loss * scale).backward(retain_graph=i + 1 < len(scales))
        return (loss.detach(), h.grad, w.grad) + tuple(m.detach() for m in metrics.values())

    routed_equals_general(monkeypatch, call, general_grpo_calls, ("loss", "dX", "dW"), case)  # then the metrics


@pytest.mark.parametrize("case", ["one launch", "in the stats launch", "sequence-first", "above its bound"])
def test_grpo_route_takes_the_label_checks_in_its_launch(tb, general_grpo_calls, monkeypatch, case):
    """At TP = 1 a routed GRPO call of at most LABELS_IN_LAUNCH_MAX_ROWS rows takes the label
    kernel's work, its mask among it, in the launch that reads its logits: GRPO's one launch of
    statistics, terms and dlogits (triton_grpo.terms_in_launch_, which the general path runs with
    the label kernel's targets), or where that one does not run (the one launch of statistics and
    dlogits switched off) the stats launch that finishes each row
    (backends.LabelLogprob.with_statistics): loss, metrics, dX and dW the general path's bit for
    bit (masked positions with any label, the sequence-first layout); above the bound the route
    launches the label kernel."""
    from dataclasses import replace

    from megatron_fused_ce.losses import GRPOConfig, linear_grpo, linear_grpo_loss

    g = torch.Generator().manual_seed(12)
    batch, hdim, vocab = 4, 16, 140
    length = tb.PROGRAMS_PER_SM * tb._sm_count(DEVICE) // batch + 3  # (rows the stats kernel takes whole)
    h0 = torch.randn(batch, length, hdim, generator=g).to(DEVICE)
    w0 = (torch.randn(150, hdim, generator=g) / math.sqrt(hdim) * 3).to(DEVICE)
    y = torch.randint(0, vocab, (batch, length), generator=g)
    mask = (torch.rand(batch, length, generator=g) > 0.3).float()
    y[mask == 0] = vocab + 7  # (a masked position's label is never read as one)
    y, mask = y.to(DEVICE), mask.to(DEVICE)
    advantages = torch.randn(batch, generator=g).to(DEVICE)
    first = case == "sequence-first"
    if case == "above its bound":
        monkeypatch.setattr(tb, "LABELS_IN_LAUNCH_MAX_ROWS", batch * length - 1)
    if case == "in the stats launch":
        monkeypatch.setattr(tb, "STATS_DLOGITS", False)
    runs, original = [], tb.BACKEND.label_logprob

    def with_statistics(logits, *args):
        runs.append(logits.shape[0])
        return original.with_statistics(logits, *args)

    monkeypatch.setattr(tb, "BACKEND", replace(tb.BACKEND, label_logprob=replace(original,
                                                                                 with_statistics=with_statistics)))
    one_launch, one_launch_kernel = [], linear_grpo._one_launch_kernel

    def counted():
        kernel = one_launch_kernel()

        def run(*args, **kwargs):
            one_launch.append("checked" if kwargs.get("local_target") is not None else "checks the labels")
            return kernel(*args, **kwargs)
        return run

    monkeypatch.setattr(linear_grpo, "_one_launch_kernel", counted)

    def call():
        h = (h0.transpose(0, 1).contiguous() if first else h0).clone().requires_grad_()
        w = w0.clone().requires_grad_()
        loss, metrics = linear_grpo_loss(h, w, y.t() if first else y, advantages, mask, GRPOConfig(),
                                         vocab_size=vocab, impl="triton", sequence_parallel=first)
        loss.backward()
        return (loss.detach(), h.grad, w.grad) + tuple(m.detach() for m in metrics.values())

    got = routed_equals_general(monkeypatch, call, general_grpo_calls, ("loss", "dX", "dW"), case)
    takes_one_launch = case in ("one launch", "sequence-first")
    # (five calls through the general path, then the routed one)
    assert one_launch == (["checked"] * 5 + ["checks the labels"] if takes_one_launch else []), one_launch
    assert runs == ([batch * length] if case == "in the stats launch" else []), runs
    assert torch.isfinite(got[0])
    deferred_errors.check_deferred_errors()


def test_grpo_route_follows_the_configs_values(tb, general_grpo_calls):
    """A config changed in place between calls is another key: the general path runs (and checks)
    the new values, never the route recorded for the old ones."""
    from megatron_fused_ce.losses import GRPOConfig, linear_grpo_loss

    g = torch.Generator().manual_seed(7)
    h = torch.randn(2, 8, 16, generator=g).to(DEVICE)
    w = torch.randn(150, 16, generator=g).to(DEVICE)
    y = torch.randint(0, 140, (2, 8), generator=g).to(DEVICE)
    mask, advantages = torch.ones(2, 8, device=DEVICE), torch.tensor([1.0, -0.5], device=DEVICE)
    config = GRPOConfig()

    def call():
        hh = h.clone().requires_grad_()
        loss, _ = linear_grpo_loss(hh, w, y, advantages, mask, config, vocab_size=140, impl="triton",
                                   old_logprobs=torch.full((2, 8), -5.0, device=DEVICE))
        loss.backward()
        return loss.detach(), hh.grad

    for _ in range(3):
        call()
    assert len(general_grpo_calls) == 2
    before = call()
    config.epsilon_high = config.epsilon_low = 0.01  # a narrower clip: another loss for these log-probs
    general_grpo_calls.clear()
    after = call()
    assert len(general_grpo_calls) == 1 and not torch.equal(before[0], after[0])
    config.epsilon_high = -1.0
    with pytest.raises(ValueError, match="epsilon_high"):
        call()


def test_grpo_route_checks_the_labels_on_the_device(tb, general_grpo_calls):
    """A routed GRPO call with a label outside the vocab: its loss and every metric are NaN (the
    per-token kernel adds the label kernel's poison and writes the loss), and the error is raised at
    the next check, as the general path's later calls do."""
    from megatron_fused_ce.losses import GRPOConfig, linear_grpo_loss

    g = torch.Generator().manual_seed(9)
    h = torch.randn(2, 8, 16, generator=g).to(DEVICE)
    w = torch.randn(150, 16, generator=g).to(DEVICE)
    y = torch.randint(0, 140, (2, 8), generator=g).to(DEVICE)
    mask, advantages = torch.ones(2, 8, device=DEVICE), torch.tensor([1.0, -0.5], device=DEVICE)

    def call(labels):
        hh = h.clone().requires_grad_()
        loss, metrics = linear_grpo_loss(hh, w, labels, advantages, mask, GRPOConfig(), vocab_size=140,
                                         impl="triton")
        loss.backward()
        return loss.detach(), metrics

    for _ in range(3):
        loss, metrics = call(y)
    assert len(general_grpo_calls) == 2 and torch.isfinite(loss)
    deferred_errors.check_deferred_errors()
    bad = y.clone()
    bad[0, 1] = 143
    general_grpo_calls.clear()
    loss, metrics = call(bad)
    assert not general_grpo_calls and loss.isnan() and all(m.isnan() for m in metrics.values())
    with pytest.raises(ValueError, match="labels outside"):
        deferred_errors.check_deferred_errors()


@pytest.mark.parametrize("path", ["cross-entropy", "log-probs", "grpo"])
def test_a_route_launches_its_logits_gemm_first(tb, monkeypatch, path):
    """A routed call launches its logits GEMM before the rest of its host work (the route's own
    checks, autograd's node, the label kernel, GRPO's per-call objects): an eager call that finds
    the GPU idle waits for whatever the host does before that launch. The node takes those logits
    over: one logits GEMM a call, none of its own. Where a check then fails, the general path runs
    and the product is dropped: the same bits."""
    from megatron_fused_ce.losses import GRPOConfig, linear_grpo, linear_grpo_loss
    from megatron_fused_ce.ops import fast

    events = []

    def recording(module, name, event):
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            events.append(event)
            return original(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    recording(remembered_routes, "logits_gemm", "gemm")
    recording(fast, "logits_gemm", "the node's gemm")
    recording(deferred_errors, "flags", "label checks")
    recording(linear_grpo, "_grpo_grads", "GRPO's per-call objects")
    recording(agreement, "still_remembered", "route checks")
    h0, w0, y, vocab = _inputs(tb, 31)

    def call():
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        if path == "cross-entropy":
            out = linear_cross_entropy(h, w, y, vocab_size=vocab, impl="triton")
        elif path == "log-probs":
            out = linear_logprobs(h, w, y, vocab_size=vocab, impl="triton").logprobs.sum()
        else:
            out, _ = linear_grpo_loss(h.view(1, *h.shape), w, y.clamp(min=0).view(1, -1), torch.ones(1, device=h.device),
                                      (y != -100).float().view(1, -1), GRPOConfig(), vocab_size=vocab, impl="triton")
        out.backward()
        return out.detach(), h.grad, w.grad

    calls = [call() for _ in range(2)]  # (the second records the route)
    events.clear()
    calls.append(call())
    assert events[0] == "gemm" and events.count("gemm") == 1 and "the node's gemm" not in events, events
    assert events.index("route checks") > 0, events
    assert "label checks" in events and (path != "grpo" or "GRPO's per-call objects" in events), events
    monkeypatch.setattr(remembered_routes, "_autocast_on", lambda device: True)  # (a check that fails)
    entry_module = {"cross-entropy": "megatron_fused_ce.losses.linear_cross_entropy", "log-probs": "megatron_fused_ce.ops.api",
                    "grpo": "megatron_fused_ce.losses.linear_grpo"}[path]
    general = count_general_calls(monkeypatch, sys.modules[entry_module])
    events.clear()
    calls.append(call())
    assert events[0] == "gemm" and events.count("gemm") == 1 and len(general) == 1, events
    for later in calls[2:]:  # the same inputs: the same bits, routed or not
        for a, b in zip(later, calls[1]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("chunk_size", [None, 16])
def test_forward_only_route_with_the_fused_statistics_gemm(tb, general_logprob_calls, monkeypatch, chunk_size):
    """Forward-only log-probs whose statistics come from the fused statistics GEMM (above
    fast.FUSED_STATS_MIN_BYTES of logits: none in memory) run a route too: that GEMM launched first
    (it reads the labels itself), then the label kernel, the merge and the log-probs; the general
    path's log-probs bit for bit, in one chunk or several (the GEMM takes every row at once)."""
    from megatron_fused_ce.ops import fast
    import megatron_fused_ce.ops.backends.triton_gemm_stats as gemm_stats  # (the interpreted one on a CPU)

    monkeypatch.setattr(fast, "FUSED_STATS_MIN_BYTES", 0)  # (the fused GEMM at this small shape)
    monkeypatch.setattr(gemm_stats, "TILE", (16, 32, 16, 4, 1))
    monkeypatch.setattr(gemm_stats, "MERGE_BLOCK_T", 4)
    events = []

    class Recorded:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            launch = self.kernel[grid]

            def run(*args, **kwargs):
                events.append("statistics GEMM")
                return launch(*args, **kwargs)
            return run

    monkeypatch.setattr(gemm_stats, "_gemm_stats_tma", Recorded(gemm_stats._gemm_stats_tma))
    monkeypatch.setattr(gemm_stats, "_gemm_stats_ptr", Recorded(gemm_stats._gemm_stats_ptr))
    flags = deferred_errors.flags
    monkeypatch.setattr(deferred_errors, "flags", lambda device: events.append("label checks") or flags(device))
    h0, w0, y, vocab = _inputs(tb, 8)
    h0, w0 = h0.bfloat16(), w0.bfloat16()

    def call():
        with torch.no_grad():
            return (linear_logprobs(h0, w0, y, vocab_size=vocab, temperature=0.7, impl="triton",
                                    chunk_size=chunk_size).logprobs,)

    events.clear()
    got = routed_equals_general(monkeypatch, call, general_logprob_calls, ("log-probs",), f"chunk_size {chunk_size}")
    assert remembered_routes.lookup(next(reversed(remembered_routes._ROUTES))).fused
    assert events.count("statistics GEMM") == 6  # (every call's statistics from the fused GEMM)
    events.clear()
    assert torch.equal(call()[0], got[0])  # routed again
    assert events[0] == "statistics GEMM" and events.count("statistics GEMM") == 1 and "label checks" in events, events
    # the same shapes, rows the fused GEMM cannot read (not 16-byte aligned; the key holds no
    # alignment): not launched ahead of the route's checks, the general path's cuBLAS product instead
    storage = torch.empty(h0.numel() + 1, dtype=h0.dtype, device=h0.device)
    misaligned = storage[1:].view(h0.shape)
    misaligned.copy_(h0)
    events.clear()
    general_logprob_calls.clear()
    with torch.no_grad():
        out = linear_logprobs(misaligned, w0, y, vocab_size=vocab, temperature=0.7, impl="triton",
                              chunk_size=chunk_size).logprobs
    assert "statistics GEMM" not in events and len(general_logprob_calls) == 1, events
    # float64, from the logits rounded to bf16 as the GEMM rounds them (its fp32 sum may round the
    # other way where float64's lies at a rounding boundary: a bf16 step, 2^-8 of the logit)
    exact = (h0.double() @ w0.double().T)[:, :vocab]
    logits = exact.bfloat16().double() / 0.7
    ref = torch.log_softmax(logits, -1).gather(1, y.clamp(min=0)[:, None])[:, 0].where(y >= 0, 0.0)
    torch.testing.assert_close(got[0].double(), ref, rtol=0, atol=3e-2)
    # the general path's logits come from cuBLAS, rounded to bf16 on their own (a GPU's bits need
    # not be the fused GEMM's): each logit within 2^-8 of itself (half a unit in the last of bf16's 8
    # significant bits), so a log-prob (its logit minus the row's log-sum-exp) within 2 x 2^-8 x
    # max |logit| / T of float64's, + fp32 arithmetic's 1e-4
    exact_ref = torch.log_softmax(exact / 0.7, -1).gather(1, y.clamp(min=0)[:, None])[:, 0].where(y >= 0, 0.0)
    bound = 2 * 2.0 ** -8 * float(exact.abs().max()) / 0.7 + 1e-4
    error = float((out.double() - exact_ref).abs().max())
    assert error <= bound, (error, bound)
