"""GRPO's one launch (triton_grpo.terms_in_launch_) against its definition, values and dlogits.

At TP = 1, a call of one chunk of every row up to a few thousand rows takes each row's statistics,
its token's GRPO terms, its dlogits and the call's metrics from one launch (where the statistics
launch, the per-token kernel and the dlogits kernel ran apart). Checked here against the torch
definition on fp32 logits: the statistics from log_softmax, each token's d loss / d lp and the
metric vector from linear_grpo._whole_call_terms (grpo.token_terms and its neighbours), the
dlogits as d loss / d lp times (one_hot - softmax) / T; for every option, with the labels checked
in the launch (the remembered route) or given checked (the general path), ignored labels, a
label mask, padded columns, temperature, sequence-first layout, normalizers, more rows than
programs. A bad label or normalizer poisons the metrics and the loss (NaN) and records its
error. Without a GPU the kernel runs under Triton's interpreter; fp32 tolerances as the per-token
kernel's own test (rtol 2e-6 on the per-token terms, 1e-5 on the metrics: sums in another order).
"""

import pytest
import torch

from grpo_cases import CONFIGS, DEVICE, triton_grpo  # noqa: F401  (first: it sets the interpreter up; the fixture)

pytest.importorskip("triton")

from megatron_fused_ce.losses import GRPOConfig  # noqa: E402
from megatron_fused_ce.losses import linear_grpo  # noqa: E402
from megatron_fused_ce.losses.grpo import metric_names  # noqa: E402
from megatron_fused_ce.ops import deferred_errors  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _case(seed, batch, length, *, cols, valid_cols, sequence_first, per_token_adv=False):
    g = torch.Generator().manual_seed(seed)
    n = batch * length
    logits = torch.randn(n, cols, generator=g) * 2
    shape = (length, batch) if sequence_first else (batch, length)
    labels = torch.randint(0, valid_cols, shape, generator=g)
    labels.view(-1)[::7] = -100  # ignored labels, some under a nonzero mask
    mask = (torch.rand(batch, length, generator=g) > 0.25).float() * (1 + torch.rand(batch, length, generator=g))
    mask[1] = 0  # an empty sequence
    adv = torch.randn(batch, length, generator=g) if per_token_adv else torch.randn(batch, generator=g)
    old = -torch.rand(batch, length, generator=g) * 4 - 1
    old[0, 2] = float("-inf")  # excluded tokens
    sampling = old + 0.3 * torch.randn(batch, length, generator=g)
    sampling[2, 1] = float("-inf")
    reference = old.clamp(min=-5) + 0.5 * torch.randn(batch, length, generator=g)  # (finite)
    return dict(logits=logits, labels=labels, mask=mask, advantages=adv, old=old, sampling=sampling,
                reference=reference)


def _expected(config, x, *, valid_cols, inv_t, old, sampling, reference, normalizer, sequence_first):
    """The definition: statistics from log_softmax (float64), terms and metrics from
    _whole_call_terms, dlogits d loss / d lp (one_hot - softmax) / T."""
    mask, labels = x["mask"], x["labels"]
    label_mask = mask.t() if sequence_first else mask
    flat = torch.where(label_mask.reshape(-1) != 0, labels.reshape(-1), -100)
    z = x["logits"].double()[:, :valid_cols] * inv_t
    row_max = z.max(1).values
    log_s = (z - row_max[:, None]).exp().sum(1).log()
    target = torch.where(flat >= 0, z.gather(1, flat.clamp(min=0)[:, None])[:, 0], 0.0)
    grad, _, metrics = linear_grpo._whole_call_terms(
        config, target.float(), row_max.float(), log_s.float(), x["advantages"], mask, old, reference, sampling,
        normalizer, labels, -100, sequence_first)
    softmax = (z - (row_max + log_s)[:, None]).exp()
    one_hot = torch.zeros_like(softmax)
    one_hot[flat >= 0, flat[flat >= 0]] = 1
    dlogits = torch.zeros_like(x["logits"], dtype=torch.float64)
    dlogits[:, :valid_cols] = grad.double()[:, None] * (one_hot - softmax) * inv_t
    return dict(max=row_max, target=target, log_s=log_s, grad=grad, metrics=metrics, dlogits=dlogits,
                local_target=flat, labelled=flat >= 0)


def _launch(triton_grpo, config, x, *, valid_cols, inv_t, old, sampling, reference, normalizer, sequence_first,
            with_labels, check_normalizer=False):
    to = lambda t: t.to(DEVICE) if isinstance(t, torch.Tensor) else t  # noqa: E731
    logits = to(x["logits"].clone())
    mask, labels = to(x["mask"]), to(x["labels"])
    label_mask = mask.t() if sequence_first else mask
    flags = deferred_errors.flags(logits.device)
    common = dict(config=config, logits=logits, advantages=to(x["advantages"]), mask=mask, old=to(old),
                  reference=to(reference), sampling=to(sampling), normalizer=to(normalizer),
                  labels=labels.reshape(-1), ignore_index=-100, sequence_first=sequence_first,
                  num_valid_cols=valid_cols, inv_temperature=inv_t, check_normalizer=check_normalizer)
    if with_labels:
        out = triton_grpo.terms_in_launch_(**common, label_mask=label_mask, true_vocab=valid_cols, flags=flags)
    else:  # the general path's: the label kernel's targets and flags
        flat = torch.where(label_mask.reshape(-1) != 0, labels.reshape(-1), -100)
        out = triton_grpo.terms_in_launch_(**common, local_target=flat.clamp(min=-1), labelled=flat >= 0,
                                           poison=torch.zeros(1, device=DEVICE))
    return out, logits


def _check(triton_grpo, config, x, *, valid_cols=None, temperature=1.0, with_old=True, with_sampling=False,
           normalizer=None, sequence_first=False, with_labels=True):
    cols = x["logits"].shape[1]
    valid_cols = cols if valid_cols is None else valid_cols
    inv_t = 1.0 / temperature
    kw = dict(valid_cols=valid_cols, inv_t=inv_t, old=x["old"] if with_old else None,
              sampling=x["sampling"] if with_sampling else None,
              reference=x["reference"] if config.beta > 0 else None, normalizer=normalizer,
              sequence_first=sequence_first)
    want = _expected(config, x, **kw)
    out, dlogits = _launch(triton_grpo, config, x, **kw, with_labels=with_labels)
    row_max, target, log_s, lse, grad, neg_grad, metrics, loss, local_target, labelled, counts, scalars = out
    torch.testing.assert_close(row_max.cpu().double(), want["max"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(target.cpu().double(), want["target"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(log_s.cpu().double(), want["log_s"], rtol=1e-5, atol=1e-6)
    assert torch.equal(lse.cpu(), (row_max + log_s).cpu())
    torch.testing.assert_close(grad.cpu(), want["grad"], rtol=2e-5, atol=1e-7)
    assert torch.equal(neg_grad, -grad)
    torch.testing.assert_close(dlogits.cpu().double(), want["dlogits"], rtol=1e-4, atol=1e-7)
    names = metric_names(config, with_sampling)
    assert metrics.shape == (len(names),)
    for name, a, b in zip(names, metrics.cpu(), want["metrics"].cpu()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    if with_labels:
        assert torch.equal(local_target.cpu(), want["local_target"].clamp(min=-1))
        assert torch.equal(labelled.cpu(), want["labelled"])
        assert counts.tolist() == [int(want["labelled"].sum()), 0]
        assert scalars[0].item() == 0.0
    torch.testing.assert_close(loss.cpu(), metrics[0].cpu(), rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_one_launch_matches_the_definition_for_every_option(triton_grpo, name):
    config = GRPOConfig(**CONFIGS[name])
    x = _case(1, 5, 7, cols=48, valid_cols=45, sequence_first=False)
    with_sampling = config.is_correction != "none" or name == "dapo"
    _check(triton_grpo, config, x, valid_cols=45, with_sampling=with_sampling, temperature=0.7)


# (config, normalizer, sequence-first, labels checked in the launch): each dimension both ways
LAYOUTS = [("dapo", None, False, True), ("dapo", "tensor", True, False), ("grpo_nonempty", None, True, True),
           ("grpo_nonempty", 7.0, False, False), ("dr_grpo_k2", 7.0, True, True), ("dr_grpo_k2", "tensor", False, True),
           ("dr_grpo_k2", None, False, False), ("grpo_nonempty", "tensor", True, False)]


@pytest.mark.parametrize("name,normalizer,sequence_first,with_labels", LAYOUTS)
def test_one_launch_layouts_and_normalizers(triton_grpo, name, normalizer, sequence_first, with_labels):
    """[T, B] labels, per-token advantages, a given normalizer, on- and off-policy, the labels checked
    in the launch or given; more tokens than the interpreter's programs (each takes several rows)."""
    config = GRPOConfig(**CONFIGS[name])
    x = _case(2, 6, 9, cols=40, valid_cols=40, sequence_first=sequence_first, per_token_adv=True)
    norm = torch.tensor(7.0) if normalizer == "tensor" else normalizer
    for with_old in (True, False):
        _check(triton_grpo, config, x, with_old=with_old, normalizer=norm, sequence_first=sequence_first,
               with_labels=with_labels)


def test_one_launch_bad_labels_and_normalizer(triton_grpo):
    """A label outside the vocabulary under the mask: its flag, the labels' verdict and NaN metrics
    and loss; a normalizer tensor that is not a count: its flag and NaN."""
    config = GRPOConfig()
    x = _case(3, 4, 5, cols=32, valid_cols=30, sequence_first=False)
    x["mask"][0, 0] = 1.0
    x["labels"][0, 0] = 31  # a padded column's index: outside [0, vocab)
    deferred_errors.take(DEVICE)  # (a clear word)
    out, _ = _launch(triton_grpo, config, x, valid_cols=30, inv_t=1.0, old=x["old"], sampling=None, reference=None,
                     normalizer=None, sequence_first=False, with_labels=True)
    metrics, loss, counts = out[6], out[7], out[10]
    assert counts[1].item() == 1
    assert torch.isnan(metrics).all() and torch.isnan(loss)
    with pytest.raises(ValueError, match="labels outside"):
        deferred_errors.check_deferred_errors()
    x = _case(4, 4, 5, cols=32, valid_cols=30, sequence_first=False)
    out, _ = _launch(triton_grpo, config, x, valid_cols=30, inv_t=1.0, old=x["old"], sampling=None, reference=None,
                     normalizer=torch.tensor(float("inf"), device=DEVICE), sequence_first=False, with_labels=True,
                     check_normalizer=True)
    assert torch.isnan(out[6][0]) and torch.isnan(out[7])
    with pytest.raises(ValueError, match="normalizer"):
        deferred_errors.check_deferred_errors()


def test_one_launch_where_the_host_sets_the_time(triton_grpo):
    """The one launch takes calls whose GEMMs are short (rows x hidden up to
    TERMS_IN_LAUNCH_MAX_WORK, within the label-checking launch's own rows): larger calls keep the
    launches apart, where the GPU's time is the call's and the one launch's is longer."""
    limit = triton_grpo.TERMS_IN_LAUNCH_MAX_WORK
    rows = 2048
    applies = lambda rows, hidden: triton_grpo.terms_in_launch_applies(rows, hidden, 1000, 2000, DEVICE)  # noqa: E731
    assert applies(rows, limit // rows)
    assert not applies(rows, limit // rows + 1)
