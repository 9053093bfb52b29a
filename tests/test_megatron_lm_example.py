"""examples/megatron_lm_pretrain.py (Megatron-LM's pretrain_gpt.py conventions + the two fused-CE
lines) on forked gloo ranks: a couple of iterations and the first batch's fused-vs-unfused loss and
MTP losses. (`torchrun --nproc_per_node 4 examples/megatron_lm_pretrain.py ...` runs the same.)"""

from __future__ import annotations

import importlib.util
import os
import re

import pytest

import test_megatron_common  # noqa: F401  (megatron-core imported before forking)
from dist import run_workers

PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                    "megatron_lm_pretrain.py")
_spec = importlib.util.spec_from_file_location("megatron_example_megatron_lm_pretrain", PATH)
EXAMPLE = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(EXAMPLE)

FAST = ["--train-iters", "2", "--seq-length", "32", "--hidden-size", "32", "--vocab-size", "200",
        "--global-batch-size", "4", "--log-interval", "1", "--use-linear-ce-fusion-loss",
        "--linear-ce-fusion-chunk-size", "16", "--compare-unfused"]


def example_worker(rank, world, argv):
    EXAMPLE.main(argv)


@pytest.mark.parametrize("world,argv", [
    (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--mtp-num-layers", "1"]),
    (2, ["--tensor-model-parallel-size", "2", "--mtp-num-layers", "2",
         "--untie-embeddings-and-output-weights", "--no-calculate-per-token-loss"]),
], ids=["tp2-pp2-mtp1", "tp2-mtp2-untied-meanloss"])
def test_megatron_lm_example(world, argv, capfd):
    run_workers(example_worker, world, FAST + argv, timeout=180)
    text = capfd.readouterr().out
    assert "fused linear CE: on" in text
    line = next(line for line in text.splitlines() if line.startswith("first batch"))
    names = re.findall(r"(lm loss|mtp_\d loss) fused", line)
    depths = int(argv[argv.index("--mtp-num-layers") + 1])
    assert names == ["lm loss"] + [f"mtp_{d + 1} loss" for d in range(depths)], line
    differences = [float(x) for x in re.findall(r"\|difference\| ([0-9.e+-]+)", line)]
    assert len(differences) == len(names) and max(differences) <= 1e-4, line
    assert "iteration 2/2: lm loss" in text and f"mtp_{depths} loss" in text.split("iteration 2/2")[1]
