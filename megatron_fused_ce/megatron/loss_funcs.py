"""Megatron `loss_func` factories for SFT / pretraining, DPO and GRPO on per-token log-probs.

A Megatron `forward_step_func` returns `(output_tensor, loss_func)`; the schedule calls
`loss_func(output_tensor)` on the last pipeline stage. The factories here build that callable for
one micro-batch:

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
        return output, sft_loss_func(post_processor, model, batch["labels"], batch["loss_mask"])

`output_tensor` is the last stage's model output by either route: the installed fused layer's
hidden states (`install_fused_output_layer`), megatron-core's `output_processor` hook with a
`FusedOutputProcessor` (its `HiddenStates`; megatron-core >= 0.18), or, fusion off, the logits.
`post_processor` is a `LogprobsPostProcessor` or a `FusedOutputProcessor` (whose settings it
then takes).

Each loss func returns `(loss_sum, count, {name: tensor([sum, count])})`, Megatron's contract for
`calculate_per_token_loss=True`: `loss_sum` is *not* normalized; the schedule adds up `count` over
micro-batches and `finalize_model_grads` divides the gradients by the total over data-parallel
ranks. So the gradient is that of the design-§3 loss with the *global* normalizer, without knowing
it in advance. The count is what the loss is normalized by: loss tokens (SFT; GRPO's token-level
types), preference pairs (DPO) or sequences (GRPO's `grpo` / `dr_grpo`). Each metric is a
`[sum, count]` pair, so that summing pairs over micro-batches and ranks and dividing gives the
count-weighted mean (Megatron-LM's training loop does exactly this).

A mask is the loss mask (× tool mask): float weights or bool. The count is the number of positions
with a non-zero weight (Megatron keeps counts as ints); for 0/1 masks this is `Σ mask`.

With fusion on, SFT (0/1 mask) and GRPO go through the gradients-in-forward losses
(`linear_cross_entropy`, `linear_grpo_loss`): the weight and input gradients are produced while
the chunk's logits are in hand, 3 GEMMs per chunk instead of 4. The value and every gradient are
those of the log-probs path (`linear_logprobs` + `megatron_fused_ce.losses`), which is used
otherwise (DPO, weighted masks, entropy requested, logits input).

Context parallelism (CP; the group comes from the post-processor: the model's or megatron's).
Each CP rank holds a slice of every sequence (labels, masks and per-token inputs cut like the
model's input, `context_parallel.batch_on_this_cp_rank`), and Megatron adds every rank's `count`, metric
pairs and parameter gradients over data-parallel × CP ranks. So that these sums are the CP=1
figures:

* token-level sums (SFT, and the `"sft_loss"` metric of DPO) stay this rank's partial sums over its
  tokens, with its own token count: they add up over CP to the whole sequences';
* sequence-level terms (DPO scores, GRPO per-sequence means, GSPO ratios, sequence-level IS
  correction; in practice the whole DPO and GRPO losses, which the losses compute with
  `cp_group`) are the same global value L on every CP rank, with each rank's gradient the CP=1
  gradient at its tokens. The loss func returns `L - L.detach() + share`, whose gradient is L's
  and whose value, the share, is L on CP rank 0 and 0 elsewhere: counted once. Sequence and pair
  counts, and the global sums and means among the metrics, are likewise counted on CP rank 0; a
  mean metric is paired with a count that adds up to its CP=1 count.

`calculate_per_token_loss=False` (Megatron divides each `loss_sum` by its own `count` and averages
the gradients over DP × CP) is exact too: under CP the loss func then returns the count summed over
the CP group (the micro-batch's CP=1 count, one more small all-reduce) and `CP · loss_sum`, so that
the average over CP ranks of `CP · loss_sum_r / count` has the gradient of `L / count`.

Bad input under CP raises the same ValueError on every CP (and TP) rank before any collective of
the loss func: different numbers of sequences, or a mask / per-token input that is not sliced like
the labels and the model output.

The gradient Megatron sends into `loss_sum`, g, is known when the loss func runs: the optimizer's
loss scale (`config.grad_scale_func`; 1 in bf16), divided, under `calculate_per_token_loss=False`,
by the count and the number of micro-batches (times CP, see above). The loss funcs pass it to the
gradients-in-forward losses as `expected_upstream_grad`, so that under gradient-accumulation fusion
the forward adds g x dW straight into `main_grad` with no buffer of its own; under
`calculate_per_token_loss=False` that needs the factories' `num_microbatches` (the one the schedule
is called with). Without it the op keeps dW in an fp32 buffer until the backward: exact either way.
"""

from __future__ import annotations

from typing import Callable, Dict, Mapping, Optional

import torch
from torch import Tensor

from megatron_fused_ce import linear_cross_entropy
from megatron_fused_ce.losses import GRPOConfig, dpo_loss, grpo_loss, linear_grpo_loss, nll_loss
from megatron_fused_ce.losses.context_parallel import agree_on_inputs, sum_over_cp
from megatron_fused_ce.losses.nll import check_normalizer
from megatron_fused_ce.ops import reductions
from megatron_fused_ce.ops.agreement import integer_argument, is_int

from .output_layer import output_weight, run_in_output_layer, unwrap_model
from .postprocess import (
    LogprobsPostProcessor,
    ReplayErrors,
    as_post_processor,
    check_model_output,
    labels_in_kept_sets,
    local_sampling_mask,
)

LossFunc = Callable[[Tensor], tuple]


def _pairs(metrics: Dict[str, Tensor], count: Tensor, sums: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """`{name: [mean·count, count]}` for mean metrics, `{name: [sum, count]}` for given sums."""
    count = count.to(torch.float32)
    out = {name: torch.stack([value.detach().float(), count]) for name, value in sums.items()}
    for name, value in metrics.items():
        if name not in out:
            out[name] = torch.stack([value.detach().float() * count, count])
    return out


def _scored_mask(post_processor: LogprobsPostProcessor, model, loss_mask: Tensor, labels: Tensor,
                 **packing) -> Tensor:
    """The loss mask, zero where the post-processor does not score a token (packed boundaries,
    ignored labels)."""
    scored = post_processor.scored_labels(labels, model, **packing) != post_processor.ignore_index
    return torch.where(scored, loss_mask.float(), torch.zeros((), device=loss_mask.device))


def _unmasked(labels: Tensor, loss_mask: Tensor, post_processor: LogprobsPostProcessor) -> Tensor:
    """The labels, ignore_index where the loss mask is 0, for the log-probs paths: a masked
    position's label is never read (a padded-vocab id or -1 there passes, as in Megatron's own loss
    and in the fused cross-entropy and GRPO paths, which skip masked tokens)."""
    return torch.where(loss_mask != 0, labels, post_processor.ignore_index)


def _count(mask: Tensor) -> Tensor:
    return (mask != 0).sum().to(torch.int)


def _without_excluded(mask: Tensor, *logprobs: Optional[Tensor]) -> Tensor:
    """The mask, zero at tokens the losses exclude (a -inf log-prob: the label is outside a
    sampler's kept set), so that Megatron's count is of the tokens that do reach the loss."""
    for values in logprobs:
        if values is not None:
            mask = torch.where(values.detach() == float("-inf"), torch.zeros_like(mask), mask)
    return mask


def _in_label_layout(mask: Tensor, inputs: dict) -> Tensor:
    """A `[b, s]` mask in the layout of the fused op's labels (`[s, b]` under sequence parallel)."""
    return mask.t() if inputs["sequence_parallel"] else mask


def _batch_layout(values: Tensor, inputs: dict) -> Tensor:
    """Values in the fused op's label layout back in `[b, s]`."""
    return values.t() if inputs["sequence_parallel"] else values


class _ContextParallel:
    """One micro-batch's CP group, and how its loss terms reach Megatron (module doc)."""

    def __init__(self, fn_name: str, post_processor: LogprobsPostProcessor, model, output_tensor,
                 labels: Tensor, per_token: Mapping[str, Optional[Tensor]], sampling_mask=None, **packing):
        check_model_output(output_tensor)  # before anything reads it as a tensor
        self.group = post_processor.context_parallel_group(model)
        self.size = reductions.group_size(self.group)
        self.rank = reductions.group_rank(self.group)
        self.model = model
        if self.group is not None:
            self._agree(fn_name, post_processor, output_tensor, labels, per_token, packing, sampling_mask)
        elif isinstance(labels, Tensor):  # (a mask of another shape would broadcast into a wrong loss)
            _check_per_token_shapes(labels, per_token, "")

    def _agree(self, fn_name, post_processor, output_tensor, labels, per_token, packing, sampling_mask=None):
        """Shapes checked on every rank and the verdict shared over CP and TP, before any
        collective (a rank that raised alone would leave the others waiting in one)."""

        def check():
            if not isinstance(labels, Tensor) or labels.dim() != 2:
                raise ValueError(f"labels must be a [b, s] tensor, got "
                                 f"{tuple(labels.shape) if isinstance(labels, Tensor) else type(labels).__name__}")
            expected = post_processor.token_shape(output_tensor, self.model)
            if tuple(labels.shape) != tuple(expected):
                raise ValueError(f"labels shape {tuple(labels.shape)} does not match the model output "
                                 f"{tuple(output_tensor.shape)} (tokens {tuple(expected)}): under context "
                                 "parallelism labels and masks are this CP rank's slice of every sequence")
            _check_per_token_shapes(labels, per_token, ": under context parallelism every per-token "
                                                        "input is this CP rank's slice, cut like the labels")
            post_processor.scored_labels(labels, self.model, **packing)  # packing offsets
            if sampling_mask is not None:  # the whole mask, on every rank: a rank's op sees its part
                vocab = post_processor.vocab_size
                if vocab is None:
                    tp = reductions.group_size(post_processor.tensor_parallel_group(self.model))
                    vocab = output_weight(unwrap_model(self.model)).shape[0] * tp
                layout = packing.get("cu_seqlens_padded")
                local_sampling_mask(sampling_mask, tuple(labels.shape), cp_group=self.group,
                                    cu_seqlens_padded=layout if layout is not None else packing.get("cu_seqlens"),
                                    vocab_size=vocab)

        agree_on_inputs(fn_name, check, cp_group=self.group,
                        other_groups=(post_processor.tensor_parallel_group(self.model),),
                        batch_size=labels.shape[0] if isinstance(labels, Tensor) and labels.dim() else None,
                        device=output_tensor.device,
                        flags=[(f"{name} given", tensor is not None) for name, tensor in per_token.items()]
                        + [("sampling_mask given", sampling_mask is not None)])

    def once(self, value: Tensor) -> Tensor:
        """`value` on CP rank 0, zero on the others: a global figure counted once over CP."""
        return value if self.rank == 0 else torch.zeros_like(value)

    def share(self, loss: Tensor) -> Tensor:
        """The loss of the whole sequences (the same on every CP rank) with its gradient, valued
        `once`: summed over CP ranks, value and gradient are those of CP=1."""
        if self.group is None:
            return loss
        return loss - loss.detach() + self.once(loss.detach())

    def sum(self, value: Tensor) -> Tensor:
        """A per-rank partial count (no gradient) summed over the CP group."""
        if self.group is None:
            return value
        with torch.no_grad():
            return sum_over_cp({"value": value.float()}, self.group)["value"]

    def _cp_scaled(self) -> bool:
        return self.group is not None and not _per_token_loss(self.model)

    def megatron_count(self, count: Tensor) -> Tensor:
        """The count returned to the schedule (`calculate_per_token_loss=False`: module doc)."""
        return torch.round(self.sum(count)).to(count.dtype) if self._cp_scaled() else count

    def for_megatron(self, loss_sum: Tensor, count: Tensor, megatron_count: Optional[Tensor] = None):
        """`(loss_sum, count)` as the schedule needs them (`calculate_per_token_loss=False`: module
        doc); `megatron_count`: megatron_count(count), if already known."""
        if megatron_count is None:
            megatron_count = self.megatron_count(count)
        return (loss_sum * self.size if self._cp_scaled() else loss_sum), megatron_count

    def upstream_grad(self, megatron_count: Tensor, num_microbatches: Optional[int],
                      inputs: dict) -> Optional[float]:
        """The gradient Megatron's schedule sends into this micro-batch's `loss_sum` (before
        for_megatron's CP factor), in the order of its fp32 operations, or None when unknown
        (calculate_per_token_loss=False without `num_microbatches`). Computed only where the op
        uses it (gradients into main_grad: it costs a host sync)."""
        if not inputs.get("accumulate_into_main_grad"):
            return None
        config = unwrap_model(self.model).config
        device = megatron_count.device
        grad_scale_func = getattr(config, "grad_scale_func", None)
        # backward_step multiplies the loss by grad_scale_func's loss scale (1 in bf16)
        g = (grad_scale_func(torch.ones(1, device=device)).reshape(()).float() if grad_scale_func is not None
             else torch.ones((), device=device))
        if not _per_token_loss(self.model):
            if num_microbatches is None:
                return None
            # forward_step: loss_sum /= clamp(count, 1); loss_sum /= num_microbatches
            g = g / num_microbatches / torch.clamp(megatron_count, min=1)
            if self._cp_scaled():
                g = g * self.size
        return float(g)


def _check_per_token_shapes(labels: Tensor, per_token: Mapping[str, Optional[Tensor]], why: str) -> None:
    """Every per-token input given has the labels' shape (`advantages` also [b] or [b, 1])."""
    for name, tensor in per_token.items():
        allowed = [tuple(labels.shape)]
        if name == "advantages" and labels.dim():
            allowed += [(labels.shape[0],), (labels.shape[0], 1)]
        if tensor is not None and (not isinstance(tensor, Tensor) or tuple(tensor.shape) not in allowed):
            got = tuple(tensor.shape) if isinstance(tensor, Tensor) else type(tensor).__name__
            raise ValueError(f"{name} shape {got} != labels shape {tuple(labels.shape)}{why}")


def _per_token_loss(model) -> bool:
    try:
        return bool(getattr(unwrap_model(model).config, "calculate_per_token_loss", True))
    except (TypeError, AttributeError):
        return True


# ------------------------------------------------------------------------------------------------
# SFT / pretraining
# ------------------------------------------------------------------------------------------------
def _count_argument(name: str, value) -> Optional[int]:
    """A factory's count argument (None, or an integer > 0: NumPy and 0-d tensors read as int);
    checked when the loss func is made, before any collective."""
    value = integer_argument(value)
    if value is not None and not (is_int(value) and value > 0):
        raise ValueError(f"{name} must be None or an integer > 0, got {value!r}")
    return value


def sft_loss_func(post_processor: LogprobsPostProcessor, model: torch.nn.Module, labels: Tensor,
                  loss_mask: Tensor, *, cu_seqlens: Optional[Tensor] = None,
                  cu_seqlens_padded: Optional[Tensor] = None,
                  num_microbatches: Optional[int] = None) -> LossFunc:
    """Token-level NLL: `loss_sum = -Σ m·lp`, count = loss tokens; metric `"lm loss"`.

    Packed sequences: `cu_seqlens` (and `cu_seqlens_padded` for THD with padding) as for the
    post-processor; under CP, the labels and mask are this rank's slice of the packed row.
    `num_microbatches`: the schedule's, for the upstream gradient under
    `calculate_per_token_loss=False` (module doc)."""
    num_microbatches = _count_argument("num_microbatches", num_microbatches)
    packing = dict(cu_seqlens=cu_seqlens, cu_seqlens_padded=cu_seqlens_padded)
    post_processor = as_post_processor(post_processor)

    def loss_func(output_tensor: Tensor):
        cp = _ContextParallel("sft_loss_func", post_processor, model, output_tensor, labels,
                              {"loss_mask": loss_mask}, **packing)
        mask = _scored_mask(post_processor, model, loss_mask, labels, **packing)
        count = _count(mask)
        inputs = None if getattr(post_processor, "filters", False) else \
            post_processor.fused_inputs(output_tensor, model, labels, **packing)
        megatron_count = None
        if inputs is not None and bool(((mask == 0) | (mask == 1)).all()):
            # Σ over loss tokens of -log p(label) = the summed cross-entropy of those tokens.
            keep = _in_label_layout(mask, inputs) != 0
            inputs["labels"] = torch.where(keep, inputs["labels"], post_processor.ignore_index)
            megatron_count = cp.megatron_count(count)
            loss_sum = run_in_output_layer(model, linear_cross_entropy, **inputs, reduction="sum",
                                           expected_upstream_grad=cp.upstream_grad(
                                               megatron_count, num_microbatches, inputs))
        else:
            lp = post_processor(output_tensor, model, _unmasked(labels, loss_mask, post_processor),
                                **packing).logprobs
            loss_sum, _ = nll_loss(lp, mask, normalizer=1)
            count = _count(_without_excluded(mask, lp))
        # token-level: this CP rank's partial sum and count (they add up over CP)
        metrics = _pairs({}, count, {"lm loss": loss_sum})
        return (*cp.for_megatron(loss_sum, count, megatron_count), metrics)

    return loss_func


# ------------------------------------------------------------------------------------------------
# DPO
# ------------------------------------------------------------------------------------------------
def dpo_loss_func(post_processor: LogprobsPostProcessor, model: torch.nn.Module, labels: Tensor,
                  loss_mask: Tensor, reference_logprobs: Tensor, *,
                  global_num_pairs: Optional[int] = None,
                  global_num_sft_tokens: Optional[int] = None, **dpo_kwargs) -> LossFunc:
    """DPO on interleaved pairs (chosen = rows 0::2, rejected = rows 1::2); count = local pairs.

    `reference_logprobs` `[2P, s]` come from a forward-only pass of the reference model
    (`compute_logprobs`). `dpo_kwargs` go to `megatron_fused_ce.losses.dpo_loss` (beta, loss_type,
    label_smoothing, average_log_probs, sft_weight, preference_weight).

    The SFT term is normalized by chosen tokens, the preference term by pairs, while Megatron
    divides everything by the total pair count; the SFT term is therefore rescaled by
    `global pairs / global chosen tokens`. Pass both global counts for an exact result with
    several micro-batches or data-parallel ranks; without them the micro-batch's own ratio is used.
    """
    for name, count in (("global_num_pairs", global_num_pairs), ("global_num_sft_tokens", global_num_sft_tokens)):
        check_normalizer(name, count)  # a count > 0 (a number or a one-element tensor), or None
    for key in ("normalizer", "sft_normalizer"):
        if key in dpo_kwargs:
            raise ValueError(f"dpo_loss_func sets {key} itself (Megatron normalizes by pair count)")
    post_processor = as_post_processor(post_processor)

    def loss_func(output_tensor: Tensor):
        cp = _ContextParallel("dpo_loss_func", post_processor, model, output_tensor, labels,
                              {"loss_mask": loss_mask, "reference_logprobs": reference_logprobs})
        lp = post_processor(output_tensor, model, _unmasked(labels, loss_mask, post_processor)).logprobs
        mask = _scored_mask(post_processor, model, loss_mask, labels)
        pairs = torch.tensor(lp.shape[0] // 2, dtype=torch.int, device=lp.device)
        chosen_mask = mask[0::2]
        if global_num_pairs is not None and global_num_sft_tokens is not None:
            sft_normalizer = global_num_sft_tokens / global_num_pairs
        else:  # no chosen token: the SFT sum is 0 whatever the (positive) normalizer
            chosen_tokens = cp.sum(chosen_mask.sum())  # of the whole sequences
            sft_normalizer = torch.where(chosen_tokens > 0, chosen_tokens, 1.0) / max(int(pairs), 1)
        # the loss of the whole pairs on every CP rank (their scores summed over CP)
        loss, metrics = dpo_loss(lp, reference_logprobs, mask, normalizer=1,
                                 sft_normalizer=sft_normalizer, cp_group=cp.group, **dpo_kwargs)
        loss_sum, pairs = cp.share(loss), cp.once(pairs)
        with torch.no_grad():  # this rank's tokens: a partial sum
            sft_sum, _ = nll_loss(lp[0::2], chosen_mask, normalizer=1)
        out = _pairs(metrics, pairs, {"loss": loss_sum,
                                      "preference_loss": cp.once(metrics["preference_loss"]),
                                      "num_excluded_tokens": cp.once(metrics["num_excluded_tokens"])})
        out["sft_loss"] = torch.stack([sft_sum.float(), chosen_mask.sum().float()])
        return (*cp.for_megatron(loss_sum, pairs), out)

    return loss_func


# ------------------------------------------------------------------------------------------------
# GRPO
# ------------------------------------------------------------------------------------------------
def grpo_logprob_passes(config: GRPOConfig) -> Dict[str, bool]:
    """Which forward-only log-prob passes a GRPO step must run before training on a batch.

    `reference`: only with a KL penalty (`beta > 0`). `old`: not with `force_on_policy_ratio`
    (the loss then uses the current log-probs, detached). Everything else is skipped. The answer
    is the config's own (`GRPOConfig.needs_reference_logprobs` / `needs_old_logprobs`), as a dict.
    """
    return {"reference": config.needs_reference_logprobs, "old": config.needs_old_logprobs}


def grpo_loss_func(post_processor: LogprobsPostProcessor, model: torch.nn.Module, labels: Tensor,
                   loss_mask: Tensor, advantages: Tensor, config: GRPOConfig, *,
                   old_logprobs: Optional[Tensor] = None,
                   reference_logprobs: Optional[Tensor] = None,
                   sampling_logprobs: Optional[Tensor] = None,
                   num_microbatches: Optional[int] = None, sampling_mask=None) -> LossFunc:
    """GRPO-family loss (`megatron_fused_ce.losses.grpo_loss`) on one micro-batch of rollouts.

    `loss_mask` is the loss mask × tool mask over the `[B, s]` rollout rows (0 on prompt, padding
    and tool tokens); `advantages` `[B]` or `[B, s]`. The count is loss tokens for
    dapo/bnpo/cispo/sapo and sequences for grpo/dr_grpo (`config.normalizer_unit`), so the
    reduction is over the whole global batch. Pass `old_logprobs` / `reference_logprobs` only when
    `grpo_logprob_passes(config)` asks for them; `sampling_logprobs` (inference engine) enable
    the importance-sampling correction. The post-processor's entropy, if on, is reported.

    Rollouts sampled with top-k / top-p / min-p: give the post-processor the rollout's sampler
    settings (`LogprobsPostProcessor(..., top_k=, top_p=, min_p=)`, and use the same one for the
    old-policy pass): the log-probs are then those of the distribution the engine sampled from, a
    token outside the trainer's kept set gets -inf and is excluded (`num_excluded_tokens`) and
    left out of the count. This takes the log-probs path (no gradients in the forward pass).
    `num_microbatches`: the schedule's, for the upstream gradient under
    `calculate_per_token_loss=False` (module doc).

    `sampling_mask` (replay, with a post-processor without sampler settings): the kept sets the
    engine sampled from (`LogprobsPostProcessor` documents the layout: `[b, s]` like `labels`, the
    whole sequences under CP). The policy's log-probs are then those of the engine's sampling
    distribution: fused, `linear_grpo_loss(..., sampling_mask=)` (its recompute path); unfused,
    the post-processor's. A token outside its set (-inf) is excluded and left out of the count;
    `reference_logprobs` stay what the caller passes (the plain softmax, normally), and the
    old-policy pass should replay the same masks (`compute_logprobs(..., sampling_mask=)`).
    """
    num_microbatches = _count_argument("num_microbatches", num_microbatches)
    if config.needs_reference_logprobs and reference_logprobs is None:
        raise ValueError(f"reference_logprobs are required when beta > 0 (beta={config.beta})")
    post_processor = as_post_processor(post_processor)

    def loss_func(output_tensor: Tensor):
        cp = _ContextParallel("grpo_loss_func", post_processor, model, output_tensor, labels,
                              {"loss_mask": loss_mask, "advantages": advantages,
                               "old_logprobs": old_logprobs, "reference_logprobs": reference_logprobs,
                               "sampling_logprobs": sampling_logprobs}, sampling_mask=sampling_mask)
        mask = _scored_mask(post_processor, model, loss_mask, labels)
        kwargs = dict(old_logprobs=old_logprobs, sampling_logprobs=sampling_logprobs, normalizer=1,
                      reference_logprobs=reference_logprobs if config.needs_reference_logprobs else None,
                      cp_group=cp.group)
        # (a post-processor that knows no masks is called as before when none is given)
        replay = {} if sampling_mask is None else {"sampling_mask": sampling_mask}
        inputs = None if post_processor.return_entropy or getattr(post_processor, "filters", False) else \
            post_processor.fused_inputs(output_tensor, model, labels, **replay)
        old = None if config.force_on_policy_ratio else old_logprobs

        def megatron_count(policy_logprobs):
            """The tokens (sequences) that reach the loss, excluded ones left out."""
            counted = _without_excluded(mask, policy_logprobs, old, sampling_logprobs)
            if config.normalizer_unit == "sequences" and (config.count_empty_sequences
                                                          or not config.per_sequence_mean):
                count = cp.once(torch.tensor(counted.shape[0], dtype=torch.int, device=counted.device))
            elif config.normalizer_unit == "sequences":  # sequences with a loss token (on any CP rank)
                count = cp.once((cp.sum((counted != 0).sum(-1)) > 0).sum().to(torch.int))
            else:  # this rank's loss tokens
                count = _count(counted)
            return count, cp.megatron_count(count)

        # the loss of the whole sequences on every CP rank (sequence terms summed over CP)
        if inputs is not None and sampling_mask is not None:  # replay: linear_grpo_loss' recompute path
            with ReplayErrors(inputs["sampling_mask"]):
                loss, metrics = run_in_output_layer(model, linear_grpo_loss, advantages=advantages, mask=mask,
                                                    config=config, **inputs, **kwargs)
            # the tokens whose replayed log-prob is -inf, from the mask (the loss keeps no log-probs)
            kept = _batch_layout(labels_in_kept_sets(inputs["sampling_mask"], inputs["labels"]), inputs)
            count, count_for_megatron = megatron_count(
                torch.where(kept, 0.0, float("-inf")).to(mask.device))
        elif inputs is not None:  # the policy's own log-probs exclude nothing: the count is known now
            count, count_for_megatron = megatron_count(None)
            loss, metrics = run_in_output_layer(
                model, linear_grpo_loss, advantages=advantages, mask=mask, config=config, **inputs, **kwargs,
                expected_upstream_grad=cp.upstream_grad(count_for_megatron, num_microbatches, inputs))
        else:
            out = post_processor(output_tensor, model, _unmasked(labels, loss_mask, post_processor), **replay)
            loss, metrics = grpo_loss(out.logprobs, advantages, mask, config, **kwargs,
                                      entropy=out.entropy)
            count, count_for_megatron = megatron_count(out.logprobs)
        # loss, pg_loss, kl and num_excluded_tokens are sums here (normalizer=1); the rest are means.
        loss_sum = cp.share(loss)
        sums = {name: cp.once(metrics[name]) for name in ("pg_loss", "kl", "num_excluded_tokens")}
        metrics = _pairs(metrics, count, {"loss": loss_sum, **sums})
        return (*cp.for_megatron(loss_sum, count, count_for_megatron), metrics)

    return loss_func
