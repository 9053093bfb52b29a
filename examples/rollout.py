"""Real GRPO rollouts for examples/grpo.py: the Megatron policy generates its own responses with an
inference engine's sampler, and a verifiable reward scores them. The same sampler draws DPO's
preference pairs (examples/dpo.py) and answers the evaluations of sft.py and dpo.py (`evaluate`);
the same task makes SFT's demonstrations (`targets`).

Sampler (vLLM V1's semantics, as `linear_logprobs` documents them), per row of full-vocab logits:

    z = logits / temperature
    min_p:  drop tokens with p < min_p * max p              (p = softmax(z))
    top_k:  keep tokens whose z is >= the k-th largest remaining z (ties at the k-th are kept)
    top_p:  over the renormalized remainder, walking z descending then id ascending, keep a token
            iff the mass strictly before it is < top_p (the smallest prefix with mass >= top_p;
            the first token is always kept)
    q = the remainder renormalized; the sampled token's log q is recorded, as an engine reports it

and, asked for (`answer(..., kept_sets=True)`; GRPO with `sampling.replay`), the kept set of every
sampled token, as vLLM's mask replay returns it: per request a `SamplingMask(token_ids, offsets)`
over its generated tokens only (CSR: token t kept token_ids[offsets[t]:offsets[t + 1]]), an empty
set where nothing was cut (no filter, or every token of the vocab kept).

Generation is a plain loop over the model (no KV cache): every step runs the tokens so far (prompt
and generated prefix) through megatron's forward-only schedule, so pipeline and context parallelism
work as in training. Under the causal mask the later positions cannot change the logits read, so
the prefix gives the logits of the whole sequence. It is padded (with not-yet-generated positions)
only as far as needed: to a multiple of 2·CP under context parallelism, of TP under sequence
parallelism, and to at least 16 positions, from which on the CPU's logits are those of the whole
sequence to the bit (`fed_length`); every rank of a replica feeds the same length, so the pipeline
stages agree on the shapes they send. The fused output layer is uninstalled meanwhile and
reinstalled afterwards (it returns hidden states, not logits); the last stage gathers the logits
of the position being sampled over the tensor-parallel (and context-parallel) ranks, samples with
a generator seeded identically on every rank of the data-parallel replica, makes the TP / CP ranks
agree by a broadcast from their first rank, and broadcasts the tokens to the other pipeline stages.

Task (verifiable, digits 0-9 are token ids 0-9, `=` is id 10): a prompt of random digits and `=`;
the response is
    count    (d + 1, d + 2, ...) mod 10 from the prompt's last digit d;
    copy     the prompt's digits, repeated;
    reverse  the prompt's digits in reverse order, repeated.
Per position: 1 for the right digit, 0.1 for another digit (a small format reward: a random
policy emits few digits), 0 otherwise; the reward is the mean over the response (0-1, partial
credit: a signal for GRPO), the accuracy its exact match (1 only for a response right throughout).

`python examples/rollout.py --plot OUT.png RUN.jsonl...` draws the reward curves of `--log-jsonl`
runs (grpo.py, and the evaluations of sft.py and dpo.py); it needs matplotlib, in the package's
`plot` extra (`pip install -e ".[plot]"`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_fused_ce.ops.replay import SamplingMask

DIGITS = 10
SEPARATOR = DIGITS  # `=`
TASKS = ("count", "copy", "reverse")


# ------------------------------------------------------------------------------------------------
# The sampler
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sampler:
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    min_p: Optional[float] = None

    @property
    def filters(self) -> bool:
        """Whether a filter may cut tokens (then the kept sets are worth recording)."""
        return (self.top_k is not None or (self.top_p is not None and self.top_p < 1.0)
                or bool(self.min_p))

    def describe(self) -> str:
        parts = [f"T={self.temperature:g}"]
        if self.top_k is not None:
            parts.append(f"top_k={self.top_k}")
        if self.top_p is not None and self.top_p < 1.0:
            parts.append(f"top_p={self.top_p:g}")
        if self.min_p:
            parts.append(f"min_p={self.min_p:g}")
        return " ".join(parts) if len(parts) > 1 else parts[0] + " (no filter)"


def sampler_logprobs(logits: torch.Tensor, sampler: Sampler) -> torch.Tensor:
    """[N, V] fp32 log q of the sampler's distribution (-inf outside its kept set) from [N, V]
    full-vocab logits (the true vocab only: no padding columns)."""
    z = logits.float() / sampler.temperature
    n, v = z.shape
    keep = torch.ones_like(z, dtype=torch.bool)
    if sampler.min_p:
        p = torch.softmax(z, dim=-1)
        keep &= p >= sampler.min_p * p.max(dim=-1, keepdim=True).values
    if sampler.top_k is not None and sampler.top_k < v:
        remaining = z.masked_fill(~keep, float("-inf"))
        kth = remaining.topk(sampler.top_k, dim=-1).values[:, -1:]
        keep &= z >= kth
    if sampler.top_p is not None and sampler.top_p < 1.0:
        # order: z descending, ties by lower id first (a stable sort of -z keeps ids ascending)
        order = torch.sort(-z, dim=-1, stable=True).indices
        q = torch.softmax(z.masked_fill(~keep, float("-inf")).double(), dim=-1).gather(1, order)
        before = torch.cumsum(q, dim=-1) - q  # mass strictly before each token, in that order
        keep &= torch.zeros_like(keep).scatter(1, order, before < sampler.top_p)
    return torch.log_softmax(z.masked_fill(~keep, float("-inf")), dim=-1)


def sample(logits: torch.Tensor, sampler: Sampler, generator: torch.Generator):
    """(tokens [N] int64, log q(token) [N] fp32): one draw per row by inverse CDF of q, from one
    uniform per row of `generator` (a CPU generator: the same draw on every device)."""
    return draw(sampler_logprobs(logits, sampler), generator)


def draw(logq: torch.Tensor, generator: torch.Generator):
    """`sample`'s draw from the sampler's log q [N, V]: (tokens [N], log q(token) [N])."""
    cdf = torch.cumsum(logq.double().exp(), dim=-1)
    u = torch.rand(logq.shape[0], 1, generator=generator, dtype=torch.float64).to(cdf.device)
    # the first token whose cumulative mass exceeds u * total: never one with q = 0
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp(max=logq.shape[1] - 1).squeeze(1)
    return tokens, logq.gather(1, tokens.unsqueeze(1)).squeeze(1)


def kept_columns(logq: torch.Tensor) -> torch.Tensor:
    """[N, V] bool: each row's kept set in the sampler's log q (-inf = cut), no column where the
    row kept the whole vocab (nothing to replay)."""
    keep = torch.isfinite(logq)
    keep &= ~keep.all(dim=1, keepdim=True)
    return keep


# `KeptSets` reads its kept columns back in blocks of at most this many bytes of [rows, vocab] bools
# (8 positions of 256 rows x 32000 ids; on the CPU larger blocks fall out of cache)
KEPT_SETS_BLOCK_BYTES = 1 << 26


class KeptSets:
    """The kept sets of the generated tokens, position by position (`add`: the [rows, vocab] bools
    of `kept_columns`, on the device), read back to the CPU in blocks of positions, each one host
    synchronization (`nonzero`'s size) instead of three at every position: a read-back waits for
    the device, which under generation's loop leaves it idle while the host catches up."""

    def __init__(self, block_bytes: int = KEPT_SETS_BLOCK_BYTES):
        self.block_bytes = block_bytes
        self.pending: List[torch.Tensor] = []  # [rows, vocab] bool per position, not read back yet
        self.blocks: List[tuple] = []  # (sizes [rows, n], ids in (row, position, id) order), CPU

    def add(self, keep: torch.Tensor) -> None:
        self.pending.append(keep)
        if len(self.pending) * keep.numel() >= self.block_bytes:
            self._read_back()

    def _read_back(self) -> None:
        if not self.pending:
            return
        rows, n = self.pending[0].shape[0], len(self.pending)
        # [rows, n, vocab]: nonzero's order is (row, position, id), each (row, position)'s ids ascending
        where = torch.stack(self.pending, dim=1).nonzero().cpu()
        self.pending = []
        sizes = torch.bincount(where[:, 0] * n + where[:, 1], minlength=rows * n).view(rows, n)
        self.blocks.append((sizes, where[:, 2]))

    def per_request(self) -> Optional[List[SamplingMask]]:
        """Per row (request), the sets of its generated tokens in order; None if none was added."""
        self._read_back()
        return _requests_of_blocks(self.blocks) if self.blocks else None


def _requests_of_blocks(blocks: Sequence[tuple]) -> List[SamplingMask]:
    """Per-request masks from blocks of consecutive generated positions, each (sizes [rows, n],
    the ids of its sets in (row, position, id) order): a row's ids are its parts of every block,
    in block order, placed by prefix sums (no loop over rows or positions)."""
    sizes = torch.cat([block_sizes.cpu() for block_sizes, _ in blocks], dim=1)  # [rows, positions]
    row_sizes = sizes.sum(dim=1)
    row_starts = torch.cumsum(row_sizes, 0) - row_sizes
    ids = torch.empty(int(row_sizes.sum()), dtype=torch.int64)
    placed = torch.zeros_like(row_sizes)  # each row's ids placed so far (earlier blocks)
    for block_sizes, block_ids in blocks:
        in_row = block_sizes.cpu().sum(dim=1)
        source_starts = torch.cumsum(in_row, 0) - in_row
        block_ids = block_ids.cpu()
        shift = torch.repeat_interleave(row_starts + placed - source_starts, in_row, output_size=block_ids.numel())
        ids[shift + torch.arange(block_ids.numel())] = block_ids
        placed += in_row
    offsets = torch.cat([sizes.new_zeros(sizes.shape[0], 1), torch.cumsum(sizes, dim=1)], dim=1)
    bounds = torch.cumsum(row_sizes, 0).tolist()
    return [SamplingMask(ids[end - size:end], offsets[row])
            for row, (end, size) in enumerate(zip(bounds, row_sizes.tolist()))]


# ------------------------------------------------------------------------------------------------
# The task and its reward
# ------------------------------------------------------------------------------------------------
def prompts(rows: int, prompt_length: int, generator: torch.Generator) -> torch.Tensor:
    """[rows, prompt_length]: prompt_length - 1 random digits, then `=`."""
    if prompt_length < 2:
        raise ValueError(f"data.prompt_length must be >= 2 (digits and `=`), got {prompt_length}")
    digits = torch.randint(0, DIGITS, (rows, prompt_length - 1), generator=generator)
    return torch.cat([digits, torch.full((rows, 1), SEPARATOR)], dim=1)


def targets(prompt: torch.Tensor, response_length: int, task: str) -> torch.Tensor:
    """[rows, response_length] the right response of each prompt."""
    digits = prompt[:, :-1]
    j = torch.arange(response_length)
    if task == "count":
        return (digits[:, -1:] + 1 + j) % DIGITS
    if task == "copy":
        return digits[:, j % digits.shape[1]]
    if task == "reverse":
        return digits.flip(1)[:, j % digits.shape[1]]
    raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")


def rewards(response: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[rows] mean per-position score: 1 right digit, 0.1 another digit, 0 any other token."""
    score = torch.where(response == target, 1.0, torch.where(response < DIGITS, 0.1, 0.0))
    return score.mean(dim=1)


def accuracy(response: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[rows] 1.0 where the whole response is right (exact match), else 0.0."""
    return (response == target).all(dim=1).float()


def group_advantages(reward: torch.Tensor, group: int) -> torch.Tensor:
    grouped = reward.view(-1, group)
    return ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(-1)


# ------------------------------------------------------------------------------------------------
# Generation with the Megatron model
# ------------------------------------------------------------------------------------------------
def generate(model, fused, prompt: torch.Tensor, seq_length: int, vocab_size: int, sampler: Sampler,
             generator: torch.Generator, *, kept_sets: bool = False):
    """Sample the responses of `prompt` [B, P] (this data-parallel replica's rows, identical on
    its TP / CP / PP ranks) with the model, up to `seq_length + 1` tokens. Returns (tokens
    [B, seq_length + 1], sampler log-probs [B, seq_length]: log q of token t+1 at t, 0 at the
    prompt), identical on every rank of the replica, and with `kept_sets` the per-request kept
    sets of the generated tokens (`per_request`) on the last pipeline stage (None on the others:
    only the last stage's loss reads them). The kept sets come from the logits the draw came from,
    identical on the TP and CP ranks of the last stage (gathered and summed the same way)."""
    from megatron.core import parallel_state

    from megatron_fused_ce.megatron import install_fused_output_layer, uninstall_fused_output_layer

    from example_common import device, micro_batches, on_this_cp_rank

    rows, start = prompt.shape
    tokens = torch.zeros(rows, seq_length + 1, dtype=torch.long, device=device())
    tokens[:, :start] = prompt.to(device())
    recorded = torch.zeros(rows, seq_length, dtype=torch.float32, device=device())
    kept = KeptSets() if kept_sets else None
    multiple = length_multiple(model, parallel_state)
    uninstall_fused_output_layer(model)  # generation needs logits
    try:
        for position in range(start, seq_length + 1):
            # every rank of the replica feeds the same length: the PP send / recv shapes agree
            length = fed_length(position, seq_length, multiple)
            (batch,) = on_this_cp_rank(micro_batches({"tokens": tokens[:, :length]}, rows))
            logits = _last_stage_logits(model, batch, position - 1, length, vocab_size)
            if logits is not None:
                logq_rows = sampler_logprobs(logits, sampler)
                new, logq = draw(logq_rows, generator)
                if kept is not None:
                    kept.add(kept_columns(logq_rows))
                new, logq = _agree(new, logq, parallel_state)
            else:
                new = logq = None
            new, logq = _to_every_stage(new, logq, rows)
            tokens[:, position] = new
            recorded[:, position - 1] = logq
    finally:
        install_fused_output_layer(model, fused)  # (a no-op with fusion off)
    if not kept_sets:
        return tokens, recorded
    return tokens, recorded, kept.per_request()


# The shortest input fed: torch's CPU softmax sums a row shorter than one vector (16 fp32 lanes
# with AVX-512) in another order than a longer one, so a shorter prefix would change the logits in
# their last bits; from this length on they are those of the whole sequence, bit for bit.
MIN_FED_LENGTH = 16


def fed_length(position: int, seq_length: int, multiple: int = 1) -> int:
    """The input length that predicts token `position`: its `position` predecessors, at least
    `MIN_FED_LENGTH`, padded up to a multiple of `multiple` (at most `seq_length`, itself one)."""
    length = max(position, MIN_FED_LENGTH)
    return min(-(-length // multiple) * multiple, seq_length)


def length_multiple(model, parallel_state) -> int:
    """What every input length must divide by: 2·CP (megatron's load-balanced CP split), and under
    sequence parallelism CP·TP (each CP rank's part is scattered over its TP ranks)."""
    from megatron.core.utils import get_model_config

    cp = parallel_state.get_context_parallel_world_size()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    multiple = 2 * cp if cp > 1 else 1
    if tp > 1 and getattr(get_model_config(model), "sequence_parallel", False):
        multiple = math.lcm(multiple, cp * tp)
    return multiple


def sampler_of(cfg) -> Sampler:
    """The sampler of a config's `rollout.temperature` and `sampling` section."""
    s = cfg["sampling"]
    return Sampler(cfg["rollout"]["temperature"], s["top_k"], s["top_p"], s["min_p"])


def answer(model, fused, cfg, prompt: torch.Tensor, sampler: Sampler, generator: torch.Generator, *,
           kept_sets: bool = False):
    """The policy's sampled answers to `prompt` [B, P] (this replica's rows): tokens
    [B, seq_length + 1] and sampler log-probs [B, seq_length] (see `generate`), and per row the
    task's reward and exact match, all on the CPU; with `kept_sets`, fifth, the per-request kept
    sets of the generated tokens (last pipeline stage; None elsewhere)."""
    data = cfg["data"]
    seq, prompt_length = data["seq_length"], prompt.shape[1]
    tokens, logq, *kept = generate(model, fused, prompt, seq, cfg["model"]["vocab_size"], sampler, generator,
                                   kept_sets=kept_sets)
    tokens, logq = tokens.cpu(), logq.cpu()
    target = targets(prompt, seq + 1 - prompt_length, cfg["rollout"]["task"])
    response = tokens[:, prompt_length:]
    return (tokens, logq, rewards(response, target), accuracy(response, target), *kept)


def check_rows(name: str, rows: int, prompt_length: int, seq_length: int, parallel_state) -> int:
    """`rows` prompts over the data-parallel ranks -> this rank's share; one line on a bad value."""
    dp = parallel_state.get_data_parallel_world_size()
    if rows % dp:
        raise SystemExit(f"{name} ({rows}) must be a multiple of the data-parallel size {dp}")
    if not 2 <= prompt_length <= seq_length:
        raise SystemExit(f"data.prompt_length ({prompt_length}) must be in [2, data.seq_length = "
                         f"{seq_length}]")
    return rows // dp


def mean_over_replicas(values, parallel_state):
    """Means of per-row [rows] tensors over the rows of every data-parallel replica (one
    all-reduce; a replica's rows are the same on all its TP / CP / PP ranks)."""
    from example_common import device

    sums = torch.tensor([float(v.double().sum()) for v in values] + [float(values[0].numel())],
                        dtype=torch.float64, device=device())
    dist.all_reduce(sums, group=parallel_state.get_data_parallel_group())
    count = max(sums[-1].item(), 1.0)
    return [s / count for s in sums[:-1].tolist()]


def evaluate(model, fused, cfg, parallel_state, sampler: Sampler):
    """(mean reward, exact-match accuracy) of the policy's sampled answers to the held-out
    prompts (`eval.num_prompts`, the same ones and the same uniforms at every evaluation, so
    that successive evaluations differ by the policy only)."""
    data = cfg["data"]
    rows = check_rows("eval.num_prompts", cfg["eval"]["num_prompts"], data["prompt_length"],
                      data["seq_length"], parallel_state)
    seed = cfg["train"]["seed"] * 999331 + 104729 * (1 + parallel_state.get_data_parallel_rank())
    prompt = prompts(rows, data["prompt_length"], torch.Generator().manual_seed(seed))
    _, _, reward, exact = answer(model, fused, cfg, prompt, sampler,
                                 torch.Generator().manual_seed(seed + 1))
    return mean_over_replicas([reward, exact], parallel_state)


def _last_stage_logits(model, batch, position: int, seq_length: int, vocab_size: int):
    """[B, vocab_size] fp32 logits at `position` on the last stage (gathered over TP and CP);
    None on the other stages. `seq_length`: the whole length of the fed sequence (of every CP rank)."""
    from megatron.core import parallel_state

    from megatron_fused_ce.megatron import positions_on_cp_rank

    from example_common import run_batches

    cp = parallel_state.get_context_parallel_world_size()
    local = positions_on_cp_rank(seq_length, cp, parallel_state.get_context_parallel_rank())
    where = (local == position).nonzero()

    def make_loss_func(chunk, _batch):
        def loss_func(output):
            # this rank's [B, V/TP] logits at `position`, or zeros where another CP rank holds it
            picked = output[:, int(where[0])] if where.numel() else output.new_zeros(output[:, 0].shape)
            # contiguous: over gloo the all-reduce of a strided view (a column of the logits) left
            # the holder's value in place and gave the other CP ranks the sum of other memory
            picked = picked.detach().float().contiguous()
            if cp > 1:
                dist.all_reduce(picked, group=parallel_state.get_context_parallel_group())
            tp_group = parallel_state.get_tensor_model_parallel_group()
            shards = [torch.empty_like(picked) for _ in range(dist.get_world_size(tp_group))]
            dist.all_gather(shards, picked.contiguous(), group=tp_group)
            zero = output.new_zeros(())
            return zero, torch.ones((), dtype=torch.int, device=zero.device), \
                {"logits": torch.cat(shards, dim=-1)[:, :vocab_size]}
        return loss_func

    with torch.no_grad():
        out = run_batches(model, [batch], make_loss_func, forward_only=True)
    return out[0]["logits"] if parallel_state.is_pipeline_last_stage() else None


def _agree(new, logq, parallel_state):
    """The same draw on every TP and CP rank of the last stage: their inputs and generators are
    identical, and one broadcast from each group's first rank makes that a guarantee."""
    for group in (parallel_state.get_tensor_model_parallel_group(),
                  parallel_state.get_context_parallel_group()):
        if dist.get_world_size(group) > 1:
            packed = torch.stack([new.double(), logq.double()])
            dist.broadcast(packed, src=dist.get_global_rank(group, 0), group=group)
            new, logq = packed[0].long(), packed[1].float()
    return new, logq


def _to_every_stage(new, logq, rows: int):
    from megatron_fused_ce.megatron import broadcast_from_last_stage

    packed = None if new is None else torch.stack([new.double(), logq.double()])
    packed = broadcast_from_last_stage(packed)
    return packed[0].long(), packed[1].float()


# ------------------------------------------------------------------------------------------------
# The importance ratio of the first update
# ------------------------------------------------------------------------------------------------
def ratio_sums(trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor,
               low: float, high: float) -> torch.Tensor:
    """[count, sum r, sum r^2, sum |log r|, max |log r|, outside [low, high], min r, max r] over
    masked tokens, r = exp(trainer - sampler) (a -inf trainer log-prob gives r = 0)."""
    m = mask != 0
    log_r = (trainer.double() - sampler.double())[m]
    r = log_r.exp()
    finite = log_r.isfinite()
    return torch.stack([
        torch.tensor(float(r.numel()), dtype=torch.float64), r.sum(), (r * r).sum(),
        log_r[finite].abs().sum(), log_r[finite].abs().max() if finite.any() else r.new_zeros(()),
        ((r < low) | (r > high)).double().sum(),
        r.min() if r.numel() else r.new_full((), math.inf),
        r.max() if r.numel() else r.new_full((), -math.inf)])


def reduce_ratio_sums(sums: torch.Tensor, group) -> Dict[str, float]:
    """Sums of several ranks -> mean, std, min, max of r, max |log r|, fraction outside the clip
    range."""
    additive = sums[[0, 1, 2, 3, 5]].clone()
    maxima = torch.stack([sums[4], -sums[6], sums[7]])
    dist.all_reduce(additive, group=group)
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
    count, s1, s2, _, outside = additive.tolist()
    mean = s1 / max(count, 1)
    return {"tokens": int(count), "mean": mean,
            "std": math.sqrt(max(s2 / max(count, 1) - mean * mean, 0.0)),
            "min": -maxima[1].item(), "max": maxima[2].item(), "max_abs_log": maxima[0].item(),
            "clipped": outside / max(count, 1)}


def ratio_table(rows: List[dict], low: float, high: float) -> str:
    """The --report-ratio table (markdown)."""
    head = (f"importance ratio r = exp(trainer - sampler log-prob) of the first update (on-policy: "
            f"ideal r = 1); clipped = tokens with r outside [{low:g}, {high:g}]\n"
            "| sampler | trainer log-probs | tokens | mean r | std r | min r | max r | max abs log r | clipped |\n"
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    lines = [head]
    for row in rows:
        s = row["stats"]
        lines.append(f"| {row['sampler']} | {row['trainer']} | {s['tokens']} | {s['mean']:.6f} | "
                     f"{s['std']:.2e} | {s['min']:.4f} | {s['max']:.4f} | {s['max_abs_log']:.2e} | "
                     f"{100 * s['clipped']:.1f} % |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Step logs (--log-jsonl) and reward curves of several runs
# ------------------------------------------------------------------------------------------------
class JsonlLog:
    """`--log-jsonl PATH`: one JSON object per line and step, written by the reporting rank only
    (the last one: it holds the loss metrics) and flushed at once, so a run that stops midway
    leaves its steps so far."""

    def __init__(self, path: Optional[str], is_reporter: bool):
        self.file = open(path, "w") if path and is_reporter else None

    def write(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def plot(out: str, paths: Sequence[str], title: str = "") -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit('examples/rollout.py --plot needs matplotlib: pip install -e ".[plot]"') from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for path in paths:
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
        label = records[0].get("label", path)
        rated = [r for r in records if "reward" in r]  # (SFT and DPO: the evaluation steps)
        axes[0].plot([r["step"] for r in rated], [r["reward"] for r in rated], label=label)
        if all("clip_ratio" in r for r in records):
            axes[1].plot([r["step"] for r in records], [r["clip_ratio"] for r in records], label=label)
    axes[0].set(xlabel="rollout step", ylabel="mean reward", title="reward")
    axes[1].set(xlabel="rollout step", ylabel="fraction of tokens", title="PPO-clipped tokens")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="examples/rollout.py",
                                     description="reward curves of grpo.py --log-jsonl runs")
    parser.add_argument("--plot", required=True, metavar="PNG", help="output image")
    parser.add_argument("--title", default="", help="figure title")
    parser.add_argument("runs", nargs="+", metavar="RUN.jsonl", help="files written by --log-jsonl")
    args = parser.parse_args()
    plot(args.plot, args.runs, args.title)
