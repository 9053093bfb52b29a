"""Fused GRPO: the GRPO-family loss straight from hidden states, gradients made in the forward pass.

    linear_grpo_loss(hidden, weight, labels, advantages, mask, config, ...)
        == grpo_loss(linear_logprobs(hidden, weight, labels, ...).logprobs, advantages, mask, config, ...)

for values and gradients, at 3 GEMMs per chunk instead of 4 (no backward recompute of the logits).

Why it is exact: once the batch totals are known (per-sequence and batch counts, and with given old
log-probs the sequence-level correction; ``grpo.BatchTotals``), every GRPO variant with token-level
importance ratios is a weighted sum of per-token terms, so d loss / d lp_t depends on lp_t and
constants alone. The totals depend on the mask and old / sampling log-probs only, so they are
computed (and summed over ``cp_group``) before the chunk loop, together with a table of what each
token's term reads (``grpo.TokenInputs``: advantage, weight, normalization weight, old / reference /
sampling log-probs). As soon as a chunk's log-probs are known (merged over TP ranks), its rows of the
table are gathered and ``grpo.term_sums`` (``grpo.token_terms``, the one definition of the per-token
math, with its closed-form derivatives; one compiled kernel on CUDA) gives d loss / d lp of each of
its tokens and the chunk's sums of the loss and metric terms (``GRPOGrads``, on the forward-gradient
contract of ops/forward_grad.py); the chunk's dlogits, dX and dW follow at once. A call whose loop
has one chunk (an RL micro-batch) takes all of this, the table and the metrics included, from one
Triton kernel where the op's backend is Triton's (ops/backends/triton_grpo.py: one launch where
the compiled function cost ~0.45 ms of host time while the GPU waited); at TP = 1 where the host
sets a call's time, in the launch that also makes the chunk's statistics and dlogits
(fast.TermsInLaunch). No context-parallel
collective runs inside the chunk loop (CP ranks may have different numbers of chunks). The loss
value and metrics are formed from the chunks' sums after the loop (one all-reduce SUM and one MAX
over ``cp_group``).

Not decomposable, hence computed with the recompute path (same result, 4 GEMMs): sequence-level
ratios (GSPO), and sequence-level train/inference correction when the old log-probs are the
policy's own (on-policy), since then rho of one token depends on the others' log-probs.

Excluded tokens (a ``-inf`` log-prob, see ``grpo.py``): those of the old / sampling log-probs are
known before the loop and enter the totals; the policy's own log-probs here are those of the full
softmax, never ``-inf``. A sampling mask (``sampling_mask``: the engine's kept sets, replayed by
``linear_logprobs``) makes some of them ``-inf``, which changes the totals during the loop: with a
mask the loss takes the recompute path (``grpo_loss`` on ``linear_logprobs(..., sampling_mask=)``).
The reference model's log-probs stay those of the plain softmax (passed in, never masked here).

A position with a nonzero mask but ``ignore_index`` as its label has log-prob 0, as
``linear_logprobs`` reports there: its term enters the loss value (without a gradient), evaluated
with its chunk.
"""

from __future__ import annotations

import functools
import warnings
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ..ops import reductions, remembered_routes
from ..ops.agreement import flag_argument, integer_argument
from ..ops.api import (CallValue, call_values, first_product_ahead, linear_logprobs, masked_labels,
                       must_agree_tensors, token_statistics)
from ..ops.forward_grad import PER_ROW, ForwardGradLoss, TokenGrads
from .grpo import (BatchTotals, GRPOConfig, TokenInputs, check_grpo_arguments, compiler_failure, field_values, fused,
                   grpo_loss, loss_and_metrics, metric_names, metric_vector, reduce_token_terms, term_sums,
                   token_inputs)
from .nll import Normalizer, given_count, is_count, read_on_host


class _TokenTable:
    """The ``TokenInputs`` of every position, one row per input, in the flat layout of ``labels``
    (the positions a chunk's tokens come with: a slice of consecutive rows, or their indices), so
    that a chunk takes its inputs at once; and which positions have a label.

    A position with a mask but no label has log-prob 0, as ``linear_logprobs`` reports there: the
    chunk's log-prob there (whatever the loop brings for a row without a target) is taken as 0."""

    def __init__(self, names: tuple, rows: Tensor, labelled: Tensor):
        self.names, self.rows, self.labelled = names, rows, labelled

    def at(self, positions) -> TokenInputs:
        rows = self.rows[:, positions] if isinstance(positions, slice) else self.rows.index_select(1, positions)
        return TokenInputs(**dict(zip(self.names, rows.unbind(0))))


def _table_rows(inputs: TokenInputs, shape, sequence_first: bool) -> Tensor:
    """[inputs, positions]: a call's TokenInputs (in `inputs.present()` order) in the flat layout of
    the labels."""
    rows = torch.stack([getattr(inputs, name).expand(shape) for name in inputs.present()])
    if sequence_first:  # [B, T] -> the [T, B] of labels
        rows = rows.transpose(1, 2)
    return rows.reshape(rows.shape[0], -1)


def _input_names(config: GRPOConfig, old_logprobs, reference_logprobs, sampling_logprobs) -> tuple:
    """The fields `token_inputs` fills for these arguments (`TokenInputs.present()`), known before it
    runs (its compiled form returns tensors only)."""
    given = {"advantages": True, "weights": True, "scale": True,
             "old": old_logprobs is not None and not config.force_on_policy_ratio,
             "reference": config.beta > 0, "sampling": sampling_logprobs is not None,
             "sequence_log_rho": sampling_logprobs is not None and config.is_correction.startswith("sequence")}
    return tuple(name for name in TokenInputs.FIELDS if given[name])


def _token_table(config: GRPOConfig, advantages, mask, old, reference, sampling, normalizer, labels,
                 ignore_index: int, sequence_first: bool):
    """The token table's rows, which positions have a label, and the BatchTotals' fields, of a call
    without context parallelism: `prepare`'s work as one function (compiled on CUDA)."""
    like = torch.zeros(mask.shape, dtype=torch.float32, device=labels.device)  # stands for the log-probs
    inputs, totals = token_inputs(advantages, mask, config, like=like, old_logprobs=old, reference_logprobs=reference,
                                  sampling_logprobs=sampling, normalizer=normalizer)
    return (_table_rows(inputs, mask.shape, sequence_first), (labels != ignore_index).reshape(-1),
            totals.sequence_weight, totals.total_weight, totals.num_excluded, totals.sequence_log_ratio,
            totals.sequence_log_rho)


class GRPOGrads(ForwardGradLoss):
    """d loss / d (target, lse) of each token of a chunk under token-level ratios, from
    ``grpo.term_sums`` on the chunk's log-probs and its rows of the token table; the chunk's sums
    of the loss and metric terms are kept for the loss value (module doc). `prepare` gives the
    table and the batch totals: called before the loop, or at the first chunk (while its logits
    GEMM runs). `whole_call` (no CP), given a chunk of every row, gives its gradients and the
    call's metric vector at once: `_whole_call_kernel` (one Triton launch) or `_whole_call_terms`
    (its definition in torch; one compiled function on CUDA), the host's cost of a micro-batch that
    fits one chunk."""

    def __init__(self, config: GRPOConfig, prepare, whole_call=None, num_rows: int = -1, has_sampling: bool = False,
                 in_launch=None, in_launch_applies=None):
        self.config, self.prepare = config, prepare
        self.whole_call, self.num_rows = whole_call, num_rows
        # (no CP) the one launch of statistics, terms and dlogits (fast.TermsInLaunch), and where it runs
        self.in_launch, self.in_launch_applies = in_launch, in_launch_applies
        self.launch_grads: Optional[TokenGrads] = None  # what that launch made
        self.has_sampling = has_sampling  # sampling log-probs given: their metrics are reported
        self.reported: Optional[Dict[str, Tensor]] = None  # a remembered route's metrics (GRPORoute.loss)
        # the call's poison where a remembered route knows it before the chunk (GRPORoute): the
        # kernel adds it to the metrics and writes the loss on its own (`loss_value`)
        self.poison: Optional[Tensor] = None
        self.loss_value: Optional[Tensor] = None
        self.table: Optional[_TokenTable] = None
        self.totals = None
        self.chunk_sums, self.chunk_maxima = [], []
        self.metric_values: Optional[Tensor] = None  # whole_call's metric vector
        self.num_tokens = 0

    def prepared(self) -> _TokenTable:
        if self.table is None:
            self.table, self.totals = self.prepare()
        return self.table

    masks_unlabelled = True  # token_grads gives 0 in rows without a label

    def terms_in_launch_applies(self, spec, rows: Tensor, weight: Tensor) -> bool:
        return self.in_launch is not None and rows.shape[0] == self.num_rows and self.in_launch_applies(
            spec, rows, weight)

    def stats_and_terms_(self, logits: Tensor, spec, **label_checks) -> Optional[tuple]:
        """triton_grpo.terms_in_launch_ on the call's one chunk (`label_checks`: the label kernel's
        targets, labelled rows and poison, or what the launch needs to check the labels itself): its
        gradients and metrics kept (token_grads, metrics), the loss on its own where the poison is in
        it. None where the kernel does not compile (the logits untouched: the caller takes the
        launches apart; the config's later calls too, _kernel_failed)."""
        try:
            out = self.in_launch(logits, spec.num_valid_cols, spec.inv_temperature, **label_checks)
        except Exception as error:  # noqa: BLE001 - a compiler failure: the launches apart compute the same
            if not compiler_failure(error):
                raise
            _kernel_failed(self.config, error)
            return None
        grad, negative_grad, self.metric_values, self.loss_value = out[4:8]
        self.launch_grads = TokenGrads(target=grad, lse=negative_grad)
        self.num_tokens = self.num_rows
        return out[:4] + (None,) + out[8:]  # (no log-probs: stats_dlogits_with_labels_' order)

    def token_grads(self, stats, positions, num_labelled) -> TokenGrads:
        if self.launch_grads is not None:  # (fast.TermsInLaunch: the whole call's, made in its launch)
            return self.launch_grads
        if (self.whole_call is not None and self.num_tokens == 0
                and isinstance(positions, slice) and positions == slice(0, self.num_rows)):
            grad, negative_grad, self.metric_values, self.loss_value = self.whole_call(
                stats.target, stats.max, stats.log_sum_exp, self.poison)
            self.num_tokens = self.num_rows
            return TokenGrads(target=grad, lse=negative_grad)
        table = self.prepared()
        inputs = table.at(positions)
        grad, negative_grad, sums, maxima = fused(
            _chunk_terms, self.config, stats.target.device, stats.target, stats.max, stats.log_sum_exp,
            table.labelled[positions], inputs.advantages, inputs.weights, inputs.scale, inputs.old, inputs.reference,
            inputs.sampling, inputs.sequence_log_rho)
        self.chunk_sums.append(sums)
        self.chunk_maxima.append(maxima)
        self.num_tokens += stats.target.shape[0]
        return TokenGrads(target=grad, lse=negative_grad)  # log p = target - lse

    def one_hot_scale(self, num_labelled) -> str:
        # each token's dlogits are -grad_i (softmax - one_hot): a row kernel's softmax - one_hot
        # times the per-token factor, applied in the GEMMs
        return PER_ROW

    def metrics(self, num_rows: int, cp_group, poison: Optional[Tensor]) -> Dict[str, Tensor]:
        """The loss value and metrics (grpo.metric_names) from the chunks' sums and the batch totals
        (one all-reduce SUM and one MAX over `cp_group`), NaN where the op's device checks found bad
        contents (`poison`, TokenStats.poison)."""
        has_sampling = self.has_sampling
        if self.num_tokens != num_rows:  # the loss value is the sum over the chunks: every row once
            raise RuntimeError(f"linear_grpo_loss: {self.num_tokens} rows reached token_grads, "
                               f"expected each of the {num_rows} rows of the chunk loop once")
        if self.metric_values is not None:  # whole_call's (the poison in them where it wrote loss_value)
            poisoned = poison is None or self.loss_value is not None
            values = self.metric_values if poisoned else self.metric_values + poison
            return dict(zip(metric_names(self.config, has_sampling), values.unbind()))
        self.prepared()
        if not self.chunk_sums:  # no row at all: the terms of an empty block
            _, _, sums, maxima = term_sums(self.config, self.table.rows.new_zeros(0), self.table.at(slice(0, 0)))
            self.chunk_sums, self.chunk_maxima = [sums], [maxima]
        total = self.chunk_sums[0] if len(self.chunk_sums) == 1 else torch.stack(self.chunk_sums).sum(0)
        largest = self.chunk_maxima[0] if len(self.chunk_maxima) == 1 else torch.stack(self.chunk_maxima).amax(0)
        if cp_group is None:  # the metrics as one compiled function on CUDA
            values = fused(_metrics, self.config, total.device, total, largest, self.totals.total_weight,
                           self.totals.num_excluded, poison, has_sampling)
            return dict(zip(metric_names(self.config, has_sampling), values.unbind()))
        loss, metrics = loss_and_metrics(self.config, has_sampling, _loss_sum(self.config, total), total, largest,
                                         self.totals, cp_group)
        return metrics if poison is None else dict(zip(metrics, (torch.stack(list(metrics.values())) + poison).unbind()))


def _chunk_terms(config: GRPOConfig, target, row_max, log_sum_exp, labelled, advantages, weights, scale, old,
                 reference, sampling, sequence_log_rho):
    """A chunk's (d loss / d lp, its negative, sums, maxima) from its merged statistics: log p =
    (target - max) - log_sum_exp, 0 in rows without a label (whose gradient is 0), then grpo's
    term_sums: one compiled function on CUDA."""
    logprobs = reductions.labelled_log_prob(target, row_max, log_sum_exp, labelled)
    grad, _, sums, maxima = reduce_token_terms(config, logprobs, advantages, weights, scale, old, reference, sampling,
                                       sequence_log_rho, None)
    grad = torch.where(labelled, grad, 0.0)
    return grad, -grad, sums, maxima


def _whole_call_terms(config: GRPOConfig, target, row_max, log_sum_exp, advantages, mask, old, reference, sampling,
                      normalizer, labels, ignore_index: int, sequence_first: bool):
    """A call without CP whose chunk loop has one chunk: its token table (`_token_table`), the
    chunk's terms (`_chunk_terms`) and the metric vector (`_metrics`, without the poison), as one
    function -> (d loss / d lp, its negative, metric vector)."""
    rows, labelled, _, total_weight, num_excluded, _, _ = _token_table(
        config, advantages, mask, old, reference, sampling, normalizer, labels, ignore_index, sequence_first)
    inputs = TokenInputs(**dict(zip(_input_names(config, old, reference, sampling), rows.unbind(0))))
    grad, negative_grad, sums, maxima = _chunk_terms(
        config, target, row_max, log_sum_exp, labelled, inputs.advantages, inputs.weights, inputs.scale, inputs.old,
        inputs.reference, inputs.sampling, inputs.sequence_log_rho)
    return grad, negative_grad, _metrics(config, sums, maxima, total_weight, num_excluded, None, sampling is not None)


@functools.lru_cache(maxsize=None)
def _kernel_module():
    """ops/backends/triton_grpo.py, or None where Triton does not import (looked up once)."""
    try:
        from ..ops.backends import triton_grpo
    except ImportError:
        return None
    return triton_grpo


def _whole_call_kernel():
    """triton_grpo.whole_call_terms (ops/backends/triton_grpo.py)."""
    return _kernel_module().whole_call_terms


def _one_launch_kernel():
    """triton_grpo.terms_in_launch_ (ops/backends/triton_grpo.py)."""
    return _kernel_module().terms_in_launch_


_FAILED_CONFIGS = set()  # field_values of the configs whose kernel did not compile


def _kernel_failed(config: GRPOConfig, error: Exception) -> None:
    """A kernel that does not compile (a Triton version's compiler bug) is not tried again for
    this config; the compiled definition runs instead, with one warning."""
    if not _FAILED_CONFIGS:
        warnings.warn(f"linear_grpo_loss: the per-token kernel failed ({type(error).__name__}: {error}); "
                      "falling back to its definition (grpo.token_terms)", RuntimeWarning, stacklevel=4)
    _FAILED_CONFIGS.add(field_values(config))


def _takes_the_kernel(impl: str, device: torch.device, config: GRPOConfig, mask: Tensor) -> bool:
    """Whether a call of one chunk takes `_whole_call_kernel` (one launch) rather than
    `_whole_call_terms` (compiled on CUDA): where the op's backend is Triton's (impl "triton", or
    "auto" on CUDA), as the chunk statistics are, and not where `fused` would run the definition
    eagerly on purpose (an enclosing torch.compile traces it; a dispatch mode counts its ops)."""
    if not (impl == "triton" or (impl == "auto" and device.type == "cuda")):
        return False
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    module = _kernel_module()
    return (module is not None and module.supported(config, mask)
            and (not _FAILED_CONFIGS or field_values(config) not in _FAILED_CONFIGS))


def _loss_sum(config: GRPOConfig, total: Tensor) -> Tensor:
    """The loss from term_sums' sum vector: Σ s·m·(ℓ·ρ) + beta Σ s·m·kl."""
    return total[0] + config.beta * total[1] if config.beta > 0 else total[0]


def _metrics(config: GRPOConfig, total, largest, total_weight, num_excluded, poison, has_sampling: bool):
    """The metric vector (grpo.metric_names order) of a call without context parallelism, NaN where
    the op's device checks found bad contents (`poison`)."""
    values = metric_vector(config, _loss_sum(config, total), total, largest, total_weight, num_excluded,
                           has_sampling=has_sampling)
    return values if poison is None else values + poison


def _must_agree(advantages, mask, old_logprobs, reference_logprobs, sampling_logprobs, normalizer) -> dict:
    """What every TP rank's per-token gradients depend on beside the labels (ranks that differ would
    sum unrelated dX parts): the agreement's on a signature's first call, the rank check's later
    (its tensors in this order, a remembered route's too)."""
    # (a number normalizer, a global token count, changes from step to step: compared across
    # ranks, not part of the call's signature)
    if normalizer is not None and not isinstance(normalizer, Tensor):
        normalizer = CallValue(normalizer)
    return dict(old_logprobs=old_logprobs, reference_logprobs=reference_logprobs, sampling_logprobs=sampling_logprobs,
                normalizer=normalizer, advantages=advantages, mask=mask)


def gradients_in_forward_apply(config: GRPOConfig, old_logprobs, sampling_logprobs) -> bool:
    """Whether each token's loss gradient is known once its own log-prob is (see module doc)."""
    if config.importance_sampling_level != "token":
        return False
    on_policy = old_logprobs is None or config.force_on_policy_ratio
    sequence_correction = sampling_logprobs is not None and config.is_correction.startswith("sequence")
    return not (sequence_correction and on_policy)


def _gradients_in_forward_or_false(config, old_logprobs, sampling_logprobs) -> bool:
    """gradients_in_forward_apply, False where `config` is not a GRPOConfig (refused by the checks)."""
    try:
        return gradients_in_forward_apply(config, old_logprobs, sampling_logprobs)
    except AttributeError:
        return False


def _grpo_grads(config: GRPOConfig, device: torch.device, labels: Tensor, advantages: Tensor, mask: Tensor,
                old_logprobs, reference_logprobs, sampling_logprobs, normalizer, ignore_index: int,
                sequence_first: bool, impl: str, cp_group) -> GRPOGrads:
    """The call's GRPOGrads: its token table and batch totals (`prepare`) and, without CP, its
    one-chunk terms (`whole_call`), each reading the call's own tensors."""
    batch, length = mask.shape
    given = normalizer
    # the per-token kernel checks a count on this GPU itself, as it reads it (a bad one: NaN and the
    # error), where nll.given_count takes five launches
    kernel_checks = (isinstance(given, Tensor) and given.numel() == 1 and given.device == device
                     and not read_on_host(given))

    @functools.cache
    def checked_normalizer():
        """A count on a GPU checked on its device; a bad number (on a remembered route, which skips
        the entry point's checks) NaN with its error recorded (nll.given_count); a good number stays
        one (a kernel argument). Once a call."""
        if isinstance(given, Tensor) or (given is not None and not is_count(float(given))):
            return given_count(given, dtype=torch.float32, device=device)
        return given

    def normalizer_tensor():
        # a Python-number normalizer as a tensor (a fill kernel): a new count is no new compilation
        normalizer = checked_normalizer()
        return normalizer if normalizer is None or isinstance(normalizer, Tensor) else torch.full(
            (), float(normalizer), dtype=torch.float32, device=device)

    # (`labels` below are the caller's: a position whose mask is 0 may hold any label there, and its
    # weight is 0, so that its terms and gradient are 0 whatever the label; the op's statistics
    # take it as ignored: label_mask)
    def prepare():
        """Everything a token's term needs from other tokens (and other CP ranks), per position."""
        if cp_group is None:  # one compiled function on CUDA (the totals' CP all-reduce cannot be in one)
            names = _input_names(config, old_logprobs, reference_logprobs, sampling_logprobs)
            rows, labelled, *totals = fused(_token_table, config, device, advantages, mask, old_logprobs,
                                            reference_logprobs, sampling_logprobs, normalizer_tensor(), labels,
                                            ignore_index, sequence_first)
            return _TokenTable(names, rows, labelled), BatchTotals(*totals)
        like = torch.zeros(batch, length, dtype=torch.float32, device=device)  # the log-probs' dtype
        inputs, totals = token_inputs(advantages, mask, config, like=like, old_logprobs=old_logprobs,
                                      reference_logprobs=reference_logprobs,
                                      sampling_logprobs=sampling_logprobs, normalizer=checked_normalizer(),
                                      cp_group=cp_group)
        return _TokenTable(inputs.present(), _table_rows(inputs, (batch, length), sequence_first),
                           (labels != ignore_index).reshape(-1)), totals

    def whole_call(target, row_max, log_sum_exp, poison=None):
        """-> (d loss / d lp, its negative, metric vector, the loss on its own or None): the kernel
        adds `poison` (where given) to the metrics and writes the loss apart."""
        inputs = (advantages, mask, old_logprobs, reference_logprobs, sampling_logprobs)
        if _takes_the_kernel(impl, device, config, mask):
            try:
                if kernel_checks:
                    return _whole_call_kernel()(config, target, row_max, log_sum_exp, *inputs, given, labels,
                                                ignore_index, sequence_first, poison=poison, check_normalizer=True)
                return _whole_call_kernel()(config, target, row_max, log_sum_exp, *inputs, checked_normalizer(),
                                            labels, ignore_index, sequence_first, poison=poison)
            except Exception as error:  # noqa: BLE001 - a compiler failure: the definition computes the same
                if not compiler_failure(error):
                    raise
                _kernel_failed(config, error)
        return fused(_whole_call_terms, config, device, target, row_max, log_sum_exp, *inputs,
                     normalizer_tensor(), labels, ignore_index, sequence_first) + (None,)

    def in_launch(logits, num_valid_cols, inv_temperature, **label_checks) -> tuple:
        """triton_grpo.terms_in_launch_ of the call's inputs (fast.TermsInLaunch)."""
        inputs = (advantages, mask, old_logprobs, reference_logprobs, sampling_logprobs)
        flat_labels = labels.reshape(-1)
        if kernel_checks:
            return _one_launch_kernel()(config, logits, *inputs, given, flat_labels, ignore_index, sequence_first,
                                        num_valid_cols, inv_temperature, check_normalizer=True, **label_checks)
        return _one_launch_kernel()(config, logits, *inputs, checked_normalizer(), flat_labels, ignore_index,
                                    sequence_first, num_valid_cols, inv_temperature, **label_checks)

    def in_launch_applies(spec, rows, weight) -> bool:
        """Where the one launch runs: the per-token kernel's conditions, and the launch's own."""
        row_bytes = weight.shape[0] * weight.element_size()
        return (_takes_the_kernel(impl, device, config, mask) and spec.backend.name == "triton"
                and _kernel_module().terms_in_launch_applies(rows.shape[0], weight.shape[1], spec.num_valid_cols,
                                                             row_bytes, device))

    return GRPOGrads(config, prepare, whole_call if cp_group is None else None, batch * length,
                     sampling_logprobs is not None, in_launch=None if cp_group is not None else in_launch,
                     in_launch_applies=in_launch_applies)


def _on_device_of(hidden, *tensors) -> tuple:
    """`tensors` (None, or anything the checks refuse, as given) on `hidden`'s device."""
    device = hidden.device if isinstance(hidden, Tensor) else None
    return tuple(t.to(device) if device is not None and isinstance(t, Tensor) and t.device != device else t
                 for t in tensors)


def linear_grpo_loss(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: GRPOConfig,
    *,
    tp_group=None,
    cp_group=None,
    vocab_size: Optional[int] = None,
    temperature: float = 1.0,
    old_logprobs: Optional[Tensor] = None,
    reference_logprobs: Optional[Tensor] = None,
    sampling_logprobs: Optional[Tensor] = None,
    normalizer: Optional[Normalizer] = None,
    chunk_size: Optional[int] = None,
    sequence_parallel: bool = False,
    impl: str = "auto",
    ignore_index: int = -100,
    accumulate_into_main_grad: bool = False,
    memory_mode: str = "fast",
    logits_dtype: Optional[torch.dtype] = None,
    max_chunk_bytes: Optional[int] = None,
    expected_upstream_grad: Optional[float] = None,
    sampling_mask=None,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """GRPO loss and metrics from hidden states (see the module doc and `grpo_loss`).

    `mask`, `advantages` and the old / reference / sampling log-probs are [B, T] (advantages may be
    [B]). `hidden` / `labels` are [B, T, H] / [B, T], or Megatron's sequence-first [T, B, H] /
    [T, B] when `sequence_parallel=True` (hidden then being this rank's [T/TP, B, H] slice).
    Tokens where mask == 0 are skipped before the first GEMM. With `cp_group`, T is this rank's
    context-parallel slice of every sequence (as for `grpo_loss`); TP and CP groups may be combined.
    Argument errors raise the same ValueError on every rank of `tp_group` and `cp_group`.
    `memory_mode`: "fast" or "lean"; `logits_dtype`: None or torch.float32; `max_chunk_bytes`: the
    bound of a chunk of logits without `chunk_size` (see `linear_logprobs`).
    `expected_upstream_grad`: the gradient the loss will receive, if known at forward time; with
    `accumulate_into_main_grad` dW then goes into main_grad in the forward with no fp32 buffer (see
    `linear_cross_entropy`).
    `sampling_mask`: the kept sets the engine sampled from (see `linear_logprobs`), in the
    row-major order of `labels` as passed ([T, B] under `sequence_parallel`; this rank's positions
    under `cp_group`: ops.replay.slice_sampling_mask): the policy's log-probs are those of the
    engine's sampling distribution, and a sampled token outside its set is excluded. Recompute
    path (module doc).
    """
    # per-token inputs given elsewhere (advantages on the CPU, say) move to hidden's device, as
    # grpo_loss moves them to its log-probs': the label and per-token kernels read them beside the logits
    advantages, mask, old_logprobs, reference_logprobs, sampling_logprobs = _on_device_of(
        hidden, advantages, mask, old_logprobs, reference_logprobs, sampling_logprobs)
    # a later call of a route the general path recorded: straight through (ops/remembered_routes.py)
    route_key = None if sampling_mask is not None or cp_group is not None else remembered_routes.call_key(
        "linear_grpo_loss", hidden, weight, labels, tp_group,
        (vocab_size, temperature, chunk_size, sequence_parallel, impl, ignore_index, accumulate_into_main_grad,
         memory_mode, logits_dtype, max_chunk_bytes, expected_upstream_grad, type(config),
         field_values(config) if isinstance(config, GRPOConfig) else None,  # (its values: a config may change)
         *map(remembered_routes.layout, (advantages, mask, old_logprobs, reference_logprobs, sampling_logprobs)),
         # (a number normalizer by its type: its value changes from step to step, api.CallValue)
         remembered_routes.layout(normalizer) if isinstance(normalizer, Tensor) else type(normalizer)))
    route = remembered_routes.lookup(route_key)
    if route is not None:  # (recorded by a call whose checks passed: mask is a [B, T] tensor)
        first = bool(sequence_parallel)

        def per_call():  # (made while the route's logits GEMM runs)
            forward_grad = _grpo_grads(config, hidden.device, labels, advantages, mask, old_logprobs,
                                       reference_logprobs, sampling_logprobs, normalizer, route.facts.ignore_index,
                                       first, impl, None)
            must_agree = _must_agree(advantages, mask, old_logprobs, reference_logprobs, sampling_logprobs, normalizer)
            return (forward_grad, mask.t() if first else mask, must_agree_tensors(must_agree),
                    call_values(must_agree))
        made = route(hidden, weight, labels, per_call=per_call)
        if made is not None:
            return made  # (the loss, the metrics)
    vocab_size, ignore_index, chunk_size, max_chunk_bytes = map(
        integer_argument, (vocab_size, ignore_index, chunk_size, max_chunk_bytes))
    sequence_parallel, accumulate_into_main_grad = map(flag_argument, (sequence_parallel, accumulate_into_main_grad))
    sequence_first = bool(sequence_parallel)
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, Tensor) and t.requires_grad for t in (hidden, weight))
    # the first GEMM before the checks, where this key made it first last time (api.first_product_ahead),
    # on the route through token_statistics below only
    ahead = (None, None)
    if sampling_mask is None and needs_grad and _gradients_in_forward_or_false(config, old_logprobs, sampling_logprobs):
        ahead = first_product_ahead("linear_grpo_loss", hidden, weight, impl, chunk_size, max_chunk_bytes,
                                    memory_mode, logits_dtype, sequence_parallel)
    loss_kwargs = dict(old_logprobs=old_logprobs, reference_logprobs=reference_logprobs,
                       sampling_logprobs=sampling_logprobs, normalizer=normalizer)

    def check_mask_and_labels():
        if not isinstance(mask, Tensor) or mask.dim() != 2:
            raise ValueError(f"mask must be a [B, T] tensor, got "
                             f"{tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__}")
        layout = tuple(mask.t().shape if sequence_first else mask.shape)
        if not isinstance(labels, Tensor) or tuple(labels.shape) != layout:
            got = tuple(labels.shape) if isinstance(labels, Tensor) else type(labels).__name__
            raise ValueError(f"mask shape {tuple(mask.shape)} does not match labels {got}: labels must "
                             f"be {'[T, B] (sequence_parallel)' if sequence_first else '[B, T]'} = {layout}")

    check_grpo_arguments("linear_grpo_loss", mask, advantages, mask, config, **loss_kwargs,
                         cp_group=cp_group, other_groups=(tp_group,), extra_check=check_mask_and_labels,
                         extra_flags=[("needs_grad", needs_grad), ("sampling_mask given", sampling_mask is not None)],
                         shape_source="mask")

    # masked tokens never reach the loss: no label (the op's label kernel takes them as ignored on
    # the gradients-in-forward path; the other paths get the labels filled with ignore_index)
    label_mask = mask.t() if sequence_first else mask
    op_kwargs = dict(tp_group=tp_group, vocab_size=vocab_size, temperature=temperature,
                     ignore_index=ignore_index, chunk_size=chunk_size,
                     sequence_parallel=sequence_parallel, impl=impl,
                     accumulate_into_main_grad=accumulate_into_main_grad, memory_mode=memory_mode,
                     logits_dtype=logits_dtype, max_chunk_bytes=max_chunk_bytes)

    def to_batch_layout(logprobs: Tensor) -> Tensor:
        return logprobs.t() if sequence_first else logprobs

    if (sampling_mask is not None or not needs_grad
            or not gradients_in_forward_apply(config, old_logprobs, sampling_logprobs)):
        logprobs = linear_logprobs(hidden, weight, masked_labels(labels, label_mask, ignore_index), **op_kwargs,
                                   sampling_mask=sampling_mask).logprobs
        return grpo_loss(to_batch_layout(logprobs), advantages, mask, config, **loss_kwargs,
                         cp_group=cp_group)

    forward_grad = _grpo_grads(config, hidden.device, labels, advantages, mask, old_logprobs, reference_logprobs,
                               sampling_logprobs, normalizer, ignore_index, sequence_first, impl, cp_group)
    # With cp_group the totals' collectives run here, on every CP rank (a rank may have no labelled
    # chunk). Without, they are computed at the first chunk's merge, while its logits GEMM runs:
    # ~30 small kernels fewer before the first GEMM, where the GPU would wait for the host.
    if cp_group is not None:
        forward_grad.prepared()

    must_agree = _must_agree(advantages, mask, **loss_kwargs)
    stats = token_statistics("linear_grpo_loss", hidden, weight, labels, **op_kwargs,
                             want_sum_logits=False, want_entropy=False, forward_grad=forward_grad,
                             must_agree=must_agree, expected_upstream_grad=expected_upstream_grad, ahead=ahead,
                             label_mask=label_mask)
    if (stats.straight is not None and route_key is not None
            and stats.straight.route in ("gradients in forward, statistics then dlogits",
                                         "gradients in forward, terms in one launch",
                                         "gradients in forward, row kernel")):
        remembered_routes.remember(route_key, remembered_routes.GRPORoute(stats.straight, impl))
    with torch.no_grad():
        metrics = forward_grad.metrics(stats.target.shape[0], cp_group, stats.poison)
    return metrics["loss"] + stats.anchor, metrics
