"""What the four examples share: command line and config, torchrun/parallel setup, a tiny GPT,
the optimizer step, progress bar, and the fused-vs-unfused check on the first batch.

Launch with torchrun. Without CUDA the processes talk over gloo and megatron-core runs in CPU mode
(`enable_cpu_mode`); with CUDA, NCCL and one GPU per process.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import textwrap
import time
import warnings
from contextlib import contextmanager
from typing import Callable, Dict, List, NoReturn, Optional

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # megatron's SP advice on GPUs

# megatron-core warns on import that Apex / Transformer Engine (and, from 0.19, absl) are missing
# (optional here, and absent on a CPU machine), that a TransformerConfig default is deprecated, and
# (0.19) that GPTModel is deprecated; it also calls deprecated torch.jit APIs, and a CUDA build of
# torch on a machine without CUDA logs where it looked for CUDA. Nothing a user of these examples
# can act on: filtered here, in the examples only (the library installs no filter), before
# megatron-core is imported.
for _message in (r"Transformer Engine and Apex are not installed", r"Apex is not installed",
                 r"full scope is deprecated", r"absl\.logging is not installed"):
    warnings.filterwarnings("ignore", message=_message, category=UserWarning, module=r"megatron\.")
# (hidden by Python's defaults, shown with -W default: deprecations inside megatron-core)
warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"megatron\.")
warnings.filterwarnings("ignore", message=r"`torch\.jit\.script_method` is deprecated",
                        category=DeprecationWarning)


class _DropLogRecords(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


logging.getLogger("megatron.core.models.gpt.gpt_model").addFilter(_DropLogRecords("GPTModel IS DEPRECATED"))
logging.getLogger("torch.utils.cpp_extension").addFilter(_DropLogRecords("No CUDA runtime is found"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from example_config import load_config, schema_for  # noqa: E402

from megatron_fused_ce.megatron import (  # noqa: E402
    FusedCEConfig,
    LogprobsPostProcessor,
    batch_on_this_cp_rank,
    context_parallel_group,
    enable_cpu_mode,
    install_fused_output_layer,
    is_fused,
    uninstall_fused_output_layer,
    with_context_parallel_attention,
)
from megatron_fused_ce.testing import PeakTensorMemory  # noqa: E402

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
INSTALL_HINT = 'pip install -e ".[megatron]"'


# ------------------------------------------------------------------------------------------------
# Command line: YAML file, then --tp/--pp/--cp/--seq-length/--steps, then `section.key=value` overrides.
# Any mistake ends here, before torchrun's processes connect: one line, exit status 2.
# ------------------------------------------------------------------------------------------------
class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Option help wrapped at spaces only: argparse's textwrap breaks "log-prob" / "sampler-fidelity"
    at the hyphen wherever the help column (set by the longest option name) puts it at a line end."""

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class ExampleArgumentParser(argparse.ArgumentParser):
    """argparse's own mistakes (an unknown flag, a bad choice or number) go through `fail`: usage and
    one error line from rank 0 only, not once per torchrun process; exit status 2, as argparse's."""

    def error(self, message: str) -> NoReturn:
        fail(self.prog, message, usage=self.format_usage())


def build_parser(example: str, description: str) -> argparse.ArgumentParser:
    default_config = os.path.join(CONFIG_DIR, f"{example}.yaml")
    schema = schema_for(example)
    keys = "\n".join(textwrap.fill(f"{section}: {', '.join(section_keys)}", width=96,
                                    initial_indent="  ", subsequent_indent="    ",
                                    break_on_hyphens=False)
                     for section, section_keys in schema.items())
    parser = ExampleArgumentParser(
        prog=f"examples/{example}.py", description=description,
        formatter_class=_HelpFormatter,
        epilog=f"config keys (any of them can be overridden with section.key=VALUE):\n{keys}")
    parser.add_argument("--config", default=default_config, metavar="YAML",
                        help=f"config file (default: examples/configs/{example}.yaml)")
    parser.add_argument("--tp", type=int, metavar="N",
                        help="tensor-parallel size (sets megatron_cfg.tensor_model_parallel_size)")
    parser.add_argument("--pp", type=int, metavar="N",
                        help="pipeline-parallel size (sets megatron_cfg.pipeline_model_parallel_size)")
    parser.add_argument("--cp", type=int, metavar="N",
                        help="context-parallel size (sets megatron_cfg.context_parallel_size): every "
                             "sequence split over N ranks")
    parser.add_argument("--seq-length", type=int, metavar="S", help="sequence length (sets data.seq_length)")
    parser.add_argument("--steps", type=int, metavar="N", help="optimizer steps (sets train.steps)")
    compared = ("the trainer's log-probs of its response tokens (the on-policy loss is 0 by "
                "construction)" if example == "grpo" else "the loss")
    parser.add_argument("--compare-unfused", action="store_true",
                        help=f"run forward+backward of the first batch with and without fusion and "
                             f"print the difference of {compared}, and the peak tensor memory of each")
    if example == "grpo":
        parser.add_argument("--report-ratio", action="store_true",
                            help="before training, print the importance ratio exp(trainer - "
                                 "sampler log-prob) of the first update for several sampler "
                                 "settings, with sampler-fidelity and with plain-softmax log-probs")
    if example in RL_EXAMPLES:
        add_rl_arguments(parser, example)
    parser.add_argument("overrides", nargs="*", metavar="section.key=VALUE",
                        help="config overrides, read as YAML values, e.g. train.lr=1e-3 "
                             "megatron_cfg.use_linear_ce_fusion_loss=false")
    return parser


RL_EXAMPLES = ("sft", "dpo", "grpo")  # the digit task's chain: SFT, then GRPO or DPO


def add_rl_arguments(parser: argparse.ArgumentParser, example: str) -> None:
    parser.add_argument("--task", choices=("count", "copy", "reverse"), metavar="TASK",
                        help="the digit task (sets rollout.task): count (on from the prompt's last "
                             "digit), copy or reverse (its digits)")
    parser.add_argument("--load", metavar="DIR",
                        help="start the policy (and the reference model, where the loss has one) "
                             "from a checkpoint written by --save, whatever its TP / PP layout")
    parser.add_argument("--save", metavar="DIR",
                        help="after the last step, write the policy as a Megatron distributed "
                             "checkpoint (megatron.core.dist_checkpointing), its model config "
                             "beside it")
    what = {"sft": "the loss, and the reward and exact-match accuracy of the evaluations",
            "dpo": "the loss and preference accuracy, and the reward and exact-match accuracy "
                   "of the evaluations",
            "grpo": "the rollout's reward and exact-match accuracy, and the loss metrics"}[example]
    parser.add_argument("--log-jsonl", metavar="PATH", help=f"write one JSON line per step: {what}")


def check_rl_arguments(prog: str, args: argparse.Namespace) -> None:
    """--load / --save mistakes end in one line before any process starts: a missing checkpoint,
    one of another model (each differing setting named), a --save directory with other files."""
    from example_checkpoint import check_load, check_save_dir

    problem = (args.load and check_load(args.load, args.cfg)) or (args.save and check_save_dir(args.save))
    if problem:
        fail(prog, problem)


def parse_args(example: str, description: str) -> argparse.Namespace:
    """Flags and config of `examples/<example>.py`; `args.cfg` is the checked config (defaults
    filled). Exits with a one-line message (status 2) on a bad flag, config key or value, a
    missing package, or a launch without torchrun."""
    parser = build_parser(example, description)
    args = parser.parse_intermixed_args()
    require_packages(parser.prog, ("yaml",))
    flags = (("megatron_cfg.tensor_model_parallel_size", args.tp),
             ("megatron_cfg.pipeline_model_parallel_size", args.pp),
             ("megatron_cfg.context_parallel_size", args.cp),
             ("data.seq_length", args.seq_length), ("train.steps", args.steps),
             ("rollout.task", getattr(args, "task", None)))
    try:
        args.cfg = load_config(example, args.config, [(k, v) for k, v in flags if v is not None],
                               args.overrides)
    except (ValueError, OSError) as err:
        fail(parser.prog, str(err))
    if example in RL_EXAMPLES:
        check_rl_arguments(parser.prog, args)
    mcfg = args.cfg["megatron_cfg"]
    require_torchrun(parser.prog, mcfg["tensor_model_parallel_size"] * mcfg["pipeline_model_parallel_size"]
                     * mcfg["context_parallel_size"])
    problem = layout_problem(args.cfg, launched_world_size())
    if problem:
        fail(parser.prog, problem)
    require_packages(parser.prog, ("tqdm", "megatron.core"))
    return args


def launched_world_size() -> int:
    """The number of processes of this launch (torchrun's WORLD_SIZE, or the group's)."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])


def layout_problem(cfg: dict, world: int) -> Optional[str]:
    """Why `world` processes cannot hold the config's parallel layout and model, or None.

    Megatron checks these too, but only after the processes connected, on every rank, with a
    traceback each (`world_size (3) is not divisible by 2` three times under torchrun); here they
    end in one line before any process group exists."""
    mcfg, m = cfg["megatron_cfg"], cfg["model"]
    tp, pp, cp = (mcfg["tensor_model_parallel_size"], mcfg["pipeline_model_parallel_size"],
                  mcfg["context_parallel_size"])
    model_size = tp * pp * cp
    if world % model_size:
        return (f"{world} processes do not split into data-parallel replicas of TP x PP x CP = "
                f"{tp} x {pp} x {cp} = {model_size} ranks: launch a multiple of {model_size} "
                f"(torchrun --nproc_per_node) or change --tp / --pp / --cp")
    if m["num_attention_heads"] % tp:
        return (f"model.num_attention_heads ({m['num_attention_heads']}) must be a multiple of the "
                f"tensor-parallel size ({tp}): each TP rank holds whole heads")
    ffn = m["ffn_hidden_size"] if m["ffn_hidden_size"] is not None else 4 * m["hidden_size"]
    if ffn % tp:
        return (f"the MLP width ({ffn}, model.ffn_hidden_size or 4 x model.hidden_size) must be a "
                f"multiple of the tensor-parallel size ({tp})")
    if m["num_layers"] % pp:
        return (f"model.num_layers ({m['num_layers']}) must be a multiple of the pipeline-parallel "
                f"size ({pp}): every stage holds the same number of layers")
    dp, train = world // model_size, cfg["train"]
    if "global_batch_size" in train and train["global_batch_size"] % (dp * train["micro_batch_size"]):
        return (f"train.global_batch_size ({train['global_batch_size']}) must split into DP = {dp} "
                f"data-parallel replicas x micro-batches of train.micro_batch_size "
                f"({train['micro_batch_size']})")
    if "num_prompts" in cfg.get("rollout", {}) and cfg["rollout"]["num_prompts"] % dp:
        return (f"rollout.num_prompts ({cfg['rollout']['num_prompts']}) must be a multiple of the "
                f"data-parallel size DP = {dp}")
    if "eval" in cfg and cfg["eval"]["num_prompts"] % dp:
        return (f"eval.num_prompts ({cfg['eval']['num_prompts']}) must be a multiple of the "
                f"data-parallel size DP = {dp}")
    return None


# How long the other ranks of a launch wait for rank 0 to print a mistake (see `fail`).
OTHER_RANKS_WAIT_S = 20.0


def fail(prog: str, message: str, usage: str = "") -> NoReturn:
    """Print `prog: error: message` (after `usage`, if given) once (rank 0 under torchrun) and exit
    with status 2."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{usage}{prog}: error: {message}", file=sys.stderr, flush=True)
    elif not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # torchrun stops every process as soon as one exits with an error: a rank that exited
        # first could take rank 0 down before it printed. The others wait; rank 0's exit ends them.
        time.sleep(OTHER_RANKS_WAIT_S)
    sys.exit(2)


_PACKAGES = {"yaml": "pyyaml", "tqdm": "tqdm", "megatron.core": "megatron-core"}


def require_packages(prog: str, modules) -> None:
    """megatron-core, PyYAML and tqdm come with the package's `megatron` extra."""
    import importlib

    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError:
            fail(prog, f"{_PACKAGES[module]} is not installed (the examples need the megatron extra): "
                       f"{INSTALL_HINT}")


def require_torchrun(prog: str, nproc: int) -> None:
    """Without torchrun's environment, say how to launch (instead of a rendezvous traceback)."""
    if dist.is_initialized() or all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        return
    command = " ".join(["OMP_NUM_THREADS=1", "torchrun", "--nproc_per_node", str(nproc), sys.argv[0]]
                       + sys.argv[1:])
    fail(prog, f"launch with torchrun (one process per GPU or CPU rank): {command}")


# ------------------------------------------------------------------------------------------------
# Processes and megatron parallel state.
# ------------------------------------------------------------------------------------------------
def init_distributed(cfg: dict, seed: int):
    """torchrun env -> process group (NCCL on CUDA, gloo otherwise) -> megatron parallel_state."""
    from megatron.core import parallel_state, tensor_parallel

    if torch.cuda.is_available():
        local_processes, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", 1)), torch.cuda.device_count()
        if local_processes > gpus:  # else ranks past the last GPU die in set_device ("invalid device ordinal")
            fail(os.path.basename(sys.argv[0]),
                 f"torchrun started {local_processes} processes on this machine, which has {gpus} GPU(s): "
                 f"run one process per GPU (--nproc_per_node {gpus}, with --tp / --pp to match), or on the "
                 f"CPU with CUDA_VISIBLE_DEVICES=\"\" (gloo)")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "nccl"
    else:
        enable_cpu_mode()
        backend = "gloo"
    if not dist.is_initialized():  # (the tests run main() in already-initialized workers)
        dist.init_process_group(backend)
        if backend == "gloo":  # share the cores between the processes on this machine
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    mcfg = cfg["megatron_cfg"]
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=mcfg["tensor_model_parallel_size"],
        pipeline_model_parallel_size=mcfg["pipeline_model_parallel_size"],
        context_parallel_size=mcfg["context_parallel_size"])
    torch.manual_seed(seed + parallel_state.get_pipeline_model_parallel_rank())
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return parallel_state


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron pads the vocab to a multiple of `divisible_by x TP` (the padding is excluded
    from the softmax by passing the true `vocab_size` to the post-processor)."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def layer_spec(mcfg: dict, config):
    """megatron-core's local layer spec, or Transformer Engine's with
    `megatron_cfg.transformer_impl: transformer_engine` (TE is imported only then). Sequence
    parallelism needs TE's norms (checked with the config). Context parallelism with the local
    spec: megatron's local attention refuses CP (only TE's implements it), so the layers get
    `GatheredKVAttention` (every rank attends over the all-gathered keys and values; exact, O(s²)
    memory: fine for this tiny model)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if mcfg["transformer_impl"] == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    spec = gpt_layer_specs.get_gpt_layer_local_spec()
    if config.context_parallel_size > 1:
        spec = with_context_parallel_attention(spec)
    return spec


def build_model(cfg: dict, parallel_state):
    """A tiny GPTModel (megatron-core local spec) wrapped in megatron's DDP, fusion installed
    per `megatron_cfg`. Returns (model, transformer_config, fused_config)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    m, mcfg, data = cfg["model"], cfg["megatron_cfg"], cfg["data"]
    tp = parallel_state.get_tensor_model_parallel_world_size()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[mcfg["dtype"]]
    config = TransformerConfig(
        num_layers=m["num_layers"], hidden_size=m["hidden_size"],
        num_attention_heads=m["num_attention_heads"], ffn_hidden_size=m["ffn_hidden_size"],
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        sequence_parallel=mcfg["sequence_parallel"] and tp > 1,
        pipeline_dtype=dtype, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        calculate_per_token_loss=True, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=not torch.cuda.is_available())
    gpt = GPTModel(
        config, layer_spec(mcfg, config),
        vocab_size=padded_vocab_size(m["vocab_size"], m["make_vocab_size_divisible_by"], tp),
        max_sequence_length=data["seq_length"],
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=m["tie_embeddings"])
    if dtype != torch.float32:
        from megatron.core.transformer.module import Float16Module

        gpt = Float16Module(config, gpt)
    gpt.to(device())
    model = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), gpt)
    config.finalize_model_grads_func = finalize_model_grads
    fused = FusedCEConfig.from_megatron_cfg(mcfg)
    install_fused_output_layer(model, fused)
    return model, config, fused


def LogprobsPostProcessorFor(cfg: dict, fused: FusedCEConfig, **kwargs) -> LogprobsPostProcessor:
    """The post-processor with the tokenizer's vocab size (the model's is padded)."""
    return LogprobsPostProcessor(fused, vocab_size=cfg["model"]["vocab_size"], **kwargs)


def build_frozen_copy(model, cfg: dict, parallel_state):
    """A reference model with the policy's current weights (DPO / GRPO KL), never trained."""
    ref, _, _ = build_model(cfg, parallel_state)
    ref.load_state_dict(model.state_dict())
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


class MainGradAdamW:
    """torch AdamW stepping on megatron DDP's fp32 `main_grad` buffers (megatron's own optimizer
    allocates CUDA tensors, so it does not run on CPU). Tied embeddings stay tied:
    `finalize_model_grads` gave both copies the same gradient. bf16 parameters are stepped through
    fp32 master copies, as megatron's mixed-precision optimizer does: an update below bf16's
    resolution (a fine-tuning learning rate) would otherwise round away; so build it after the
    weights are loaded. A demo optimizer: no gradient clipping."""

    def __init__(self, model, lr: float, weight_decay: float = 0.0):
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p.detach().float() if p.dtype != torch.float32 else p for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, lr=lr, weight_decay=weight_decay)

    def zero_grad(self):
        self.model.zero_grad_buffer()

    def step(self):
        for p, master in zip(self.params, self.masters):
            master.grad = p.main_grad.float()
        self.opt.step()
        with torch.no_grad():
            for p, master in zip(self.params, self.masters):
                master.grad = None
                if master is not p:
                    p.copy_(master)


# ------------------------------------------------------------------------------------------------
# Mock data: learnable token patterns, different on every data-parallel rank and step.
# ------------------------------------------------------------------------------------------------
def pattern_sequences(rows: int, length: int, vocab_size: int, generator) -> torch.Tensor:
    """Arithmetic progressions mod vocab (random start and stride <= 8): after a couple of tokens
    the continuation is predictable, so the loss visibly drops within a few dozen steps."""
    start = torch.randint(0, vocab_size, (rows, 1), generator=generator)
    stride = torch.randint(1, 9, (rows, 1), generator=generator)
    return (start + stride * torch.arange(length)) % vocab_size


def causal_mask(seq_length: int) -> torch.Tensor:
    """[1, 1, s, s], True = masked (megatron's convention); passed explicitly to the model."""
    return torch.triu(torch.ones(1, 1, seq_length, seq_length, dtype=torch.bool), diagonal=1)


def micro_batches(rows: Dict[str, torch.Tensor], micro_batch_size: int) -> List[dict]:
    """Split `[R, ...]` tensors into micro-batch dicts on the compute device; adds position ids
    and the causal mask unless given."""
    total = next(iter(rows.values())).shape[0]
    out = []
    for start in range(0, total, micro_batch_size):
        batch = {k: v[start:start + micro_batch_size].to(device()) for k, v in rows.items()}
        b, s = batch["tokens"].shape
        batch.setdefault("position_ids", torch.arange(s, device=device()).unsqueeze(0).expand(b, s))
        batch.setdefault("attention_mask", causal_mask(s).to(device()))
        out.append(batch)
    return out


def on_this_cp_rank(batches: List[dict]) -> List[dict]:
    """This context-parallel rank's slice of every micro-batch, as megatron's
    `get_batch_on_this_cp_rank` cuts it (every CP rank of a data-parallel replica builds the same
    whole batches; unchanged without CP). Per-sequence entries (advantages) stay whole."""
    group = context_parallel_group()
    return [batch_on_this_cp_rank(batch, group) for batch in batches]


def rows_per_rank(cfg: dict, parallel_state) -> int:
    train = cfg["train"]
    dp = parallel_state.get_data_parallel_world_size()
    per_rank, rest = divmod(train["global_batch_size"], dp)
    if rest or per_rank % train["micro_batch_size"]:
        raise SystemExit(f"global_batch_size {train['global_batch_size']} must split into DP={dp} "
                         f"ranks x micro-batches of {train['micro_batch_size']}")
    return per_rank


def data_generator(cfg: dict, parallel_state, step: int) -> torch.Generator:
    seed = cfg["train"]["seed"] * 1000003 + step * 1009 + parallel_state.get_data_parallel_rank()
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------------
# Running micro-batches through megatron's schedule.
# ------------------------------------------------------------------------------------------------
def forward_fn(model, batch):
    if batch.get("cu_seqlens_padded") is not None:  # THD: one packed row, no attention mask
        return model(batch["tokens"], batch["position_ids"], None,
                     packed_seq_params=packed_seq_params(batch))
    return model(batch["tokens"], batch["position_ids"], batch["attention_mask"])


def packed_seq_params(batch):
    """megatron's PackedSeqParams of a THD micro-batch (`cu_seqlens`: real lengths,
    `cu_seqlens_padded`: where each document sits; Transformer Engine's attention takes both)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    real, padded = batch["cu_seqlens"].int(), batch["cu_seqlens_padded"].int()
    longest = int((padded[1:] - padded[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real,
                           cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def run_batches(model, batches: List[dict], make_loss_func: Callable,
                forward_only: bool = False) -> List[dict]:
    """One `get_forward_backward_func` call over `batches` (micro-batches, of this CP rank)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, chunk):
        batch = next(data_iterator)
        return forward_fn(chunk, batch), make_loss_func(chunk, batch)

    rows, length = batches[0]["tokens"].shape
    # the backward on this thread: with one GPU a process, autograd's device thread only adds its
    # hand-off (~0.3 ms of host a backward on H200 hosts; docs/performance.md, "RL passes")
    with torch.autograd.set_multithreading_enabled(False):
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
            num_microbatches=len(batches), micro_batch_size=rows, forward_only=forward_only,
            seq_length=length * parallel_state.get_context_parallel_world_size())  # the whole sequence


def optimizer_step(model, optimizer, progress, batches: List[dict], make_loss_func: Callable,
                   parallel_state) -> Dict[str, float]:
    """One optimizer step over a batch of micro-batches (the peak memory of the output layer and
    the loss measured meanwhile); its metrics reduced over data-parallel ranks."""
    optimizer.zero_grad()
    with progress.measure_memory(model):
        metrics = run_batches(model, batches, make_loss_func)
    optimizer.step()
    return reduce_metrics(metrics, parallel_state)


def train_sft(args, cfg: dict, model, fused: FusedCEConfig, parallel_state, make_batches: Callable,
              make_loss_func: Callable, name: str) -> None:
    """pretrain_gpt.py's loop: one optimizer step per batch of micro-batches; on the first step,
    with --compare-unfused, the fused-vs-unfused loss. (sft.py adds evaluations and a stop.)"""
    train, seq = cfg["train"], cfg["data"]["seq_length"]
    optimizer = MainGradAdamW(model, lr=train["lr"])
    progress = Progress(train["steps"], name)
    progress.write(describe(name, cfg, fused, parallel_state))
    for step in range(train["steps"]):
        batches = on_this_cp_rank(make_batches(cfg, parallel_state, step))
        if step == 0 and args.compare_unfused:
            progress.write(compare_unfused(model, fused, batches, make_loss_func, parallel_state,
                                           "lm loss"))
        progress.update(optimizer_step(model, optimizer, progress, batches, make_loss_func, parallel_state),
                        tokens=train["global_batch_size"] * seq)
    progress.close()
    shutdown()


def reduce_metrics(metrics: List[Dict[str, torch.Tensor]], parallel_state) -> Dict[str, float]:
    """Sum the `[sum, count]` pairs over micro-batches and data-parallel x context-parallel ranks
    -> means (as Megatron-LM's training loop does). Only meaningful on the last pipeline stage
    (empty elsewhere)."""
    if not metrics:
        return {}
    totals = {k: torch.stack([m[k] for m in metrics]).sum(0) for k in metrics[0]}
    names = sorted(totals)
    packed = torch.stack([totals[k].float() for k in names]).to(device())
    dist.all_reduce(packed, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    return {k: (v[0] / v[1].clamp(min=1)).item() for k, v in zip(names, packed)}


@contextmanager
def output_layer(model, fused_on: bool, chunk_size: Optional[int]):
    """Temporarily run with (or without) the fused output layer, then restore what was there."""
    was_fused = _is_last(model) and is_fused(model)
    if fused_on:
        install_fused_output_layer(model, FusedCEConfig(enabled=True, chunk_size=chunk_size))
    else:
        uninstall_fused_output_layer(model)
    try:
        yield
    finally:
        if was_fused:
            install_fused_output_layer(model, FusedCEConfig(enabled=True, chunk_size=chunk_size))
        else:
            uninstall_fused_output_layer(model)


def _is_last(model) -> bool:
    from megatron_fused_ce.megatron import unwrap_model

    return bool(getattr(unwrap_model(model), "post_process", False))


def compare_unfused(model, fused: FusedCEConfig, batches, make_loss_func, parallel_state,
                    key: str) -> Optional[str]:
    """Forward+backward of `batches` with and without fusion -> a one-line report on the last rank:
    the loss of each, and the peak tensor memory of the output layer + loss of each (see
    `loss_memory`). Works whether or not `megatron_cfg` switched fusion on. The gradients it
    leaves in the grad buffers are zeroed by the next optimizer step's zero_grad."""
    results, peaks = {}, {}
    for fused_on in (True, False):
        with output_layer(model, fused_on, fused.chunk_size):
            with loss_memory(model) as memory:
                metrics = run_batches(model, batches, make_loss_func)
            results[fused_on] = reduce_metrics(metrics, parallel_state)
            peaks[fused_on] = memory.peak_bytes
    if not results[True]:
        return None
    a, b = results[True][key], results[False][key]
    return (f"first batch, {key}: fused {a:.6f} vs unfused {b:.6f}, |difference| {abs(a - b):.2e} "
            f"(relative {abs(a - b) / max(abs(b), 1e-12):.2e}); output layer + loss, peak tensor "
            f"memory: fused {mib(peaks[True])} vs unfused {mib(peaks[False])}")


@contextmanager
def loss_memory(model):
    """Peak tensor memory of what the fused op replaces: the output layer and the loss, forward
    and backward, of each micro-batch on this rank (`PeakTensorMemory`: live tensor bytes on the
    CPU, max_memory_allocated on CUDA). Counting starts when the output layer is called and stops
    when the gradient reaches its input; nothing is counted off the last pipeline stage."""
    from megatron_fused_ce.megatron import unwrap_model

    memory = PeakTensorMemory(device(), paused=True)
    gpt = unwrap_model(model)
    if not getattr(gpt, "post_process", False):
        yield memory
        return

    def start(module, args, kwargs):
        hidden = args[0] if args else kwargs["input_"]
        memory.resume()
        if hidden.requires_grad:
            hidden.register_hook(lambda grad: memory.pause())

    handle = gpt.output_layer.register_forward_pre_hook(start, with_kwargs=True)
    try:
        with memory:
            yield memory
    finally:
        handle.remove()


def mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.2f} MiB"


# ------------------------------------------------------------------------------------------------
# Progress: a tqdm bar on the last rank (on the last pipeline stage, where the loss is).
# ------------------------------------------------------------------------------------------------
class Progress:
    """The progress bar of the last rank, on the last pipeline stage. `loss_mem` is the peak
    tensor memory of the output layer + loss there (`loss_memory`, first step), where the fused op
    saves the `[tokens, V/TP]` logits."""

    def __init__(self, steps: int, desc: str):
        self.is_reporter = dist.get_rank() == dist.get_world_size() - 1
        self.bar = None
        if self.is_reporter:
            from tqdm import tqdm

            self.bar = tqdm(total=steps, desc=desc, dynamic_ncols=True, file=sys.stdout)
        self.last = time.perf_counter()
        self.peak_bytes = 0
        self.measured = False

    @contextmanager
    def measure_memory(self, model):
        """`loss_memory(model)` of the block, on the reporting rank, in the first step only: the
        shapes never change, and on the CPU the tracker slows every operator down."""
        if not self.is_reporter or self.measured:
            yield
            return
        with loss_memory(model) as memory:
            yield
        self.peak_bytes = max(self.peak_bytes, memory.peak_bytes)

    def update(self, metrics: Dict[str, float], tokens: int, **extra):
        now = time.perf_counter()
        tokens_per_s = tokens / max(now - self.last, 1e-9)
        self.last = now
        if self.bar is not None:
            shown = {k: f"{v:.4f}" for k, v in metrics.items()}
            shown.update({"tok/s": f"{tokens_per_s:.0f}", "loss_mem": mib(self.peak_bytes).replace(" ", "")})
            shown.update({k: str(v) for k, v in extra.items()})
            self.bar.set_postfix(shown, refresh=False)
            self.bar.update(1)
        self.measured = True

    def write(self, line: Optional[str]):
        if self.is_reporter and line:
            (self.bar.write if self.bar is not None else print)(line)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def describe(name: str, cfg: dict, fused: FusedCEConfig, parallel_state, extra: str = "") -> str:
    """The one header line of a run."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    dp = parallel_state.get_data_parallel_world_size()
    cp = parallel_state.get_context_parallel_world_size()
    m = cfg["model"]
    # lean mode takes no chunk size: it walks tiles of a fixed working set
    mode = "lean tiles" if fused.memory_mode == "lean" else \
        f"chunk {'auto' if fused.chunk_size is None else fused.chunk_size}"
    if fused.logits_dtype is not None:
        mode += f", {fused.logits_dtype} logits"
    return (f"{name}: world {dist.get_world_size()} = TP {tp} x {f'CP {cp} x ' if cp > 1 else ''}"
            f"PP {pp} x DP {dp} on "
            f"{'CUDA/NCCL' if torch.cuda.is_available() else 'CPU/gloo'}; model {m['num_layers']} "
            f"layers, hidden {m['hidden_size']}, vocab {m['vocab_size']}; "
            f"fused linear CE: {'on' if fused.enabled else 'off'} ({mode}){extra}")


def shutdown():
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()

