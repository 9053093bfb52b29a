"""tools/make_text_dataset.py (BPE tokenizer + Megatron indexed dataset of the stdlib sources) and a
few training steps on it through examples/megatron_lm_pretrain.py, which reads it with
megatron-core's GPTDataset as Megatron-LM does."""

from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest

pytest.importorskip("tokenizers")

import megatron_harness  # noqa: E402,F401  (megatron-core imported before forking)
from dist import run_workers  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name, *parts):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, *parts))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOOL = _load("make_text_dataset_tool", "tools", "make_text_dataset.py")
EXAMPLE = _load("megatron_example_megatron_lm_pretrain_text", "examples", "megatron_lm_pretrain.py")


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("stdlib_text")
    summary = TOOL.build(out, vocab_size=320, max_files=6, quiet=True)
    return out, summary


def test_dataset_files_and_contents(small_dataset):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from tokenizers import ByteLevelBPETokenizer

    out, summary = small_dataset
    for name in ("text_document.bin", "text_document.idx", "vocab.json", "merges.txt",
                 "tokenizer.json", "tokenizer_config.json", "dataset.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "dataset.json").read_text()) == json.loads(json.dumps(summary))
    assert summary["files"] == summary["documents"] == 6 and summary["vocab_size"] == 320
    vocab = json.loads((out / "vocab.json").read_text())
    assert len(vocab) == 320 and vocab[TOOL.EOD] == summary["eod_id"]

    dataset = IndexedDataset(summary["data_path"])
    assert len(dataset) == 6 and sum(len(dataset[i]) for i in range(6)) == summary["tokens"]
    # GPT-2 files read back by a fresh tokenizer: the first document is the first source file
    _, files = TOOL.stdlib_sources(max_files=6)
    tokenizer = ByteLevelBPETokenizer(str(out / "vocab.json"), str(out / "merges.txt"))
    first = dataset[0].tolist()
    assert first[-1] == summary["eod_id"] and summary["eod_id"] not in first[:-1]
    assert tokenizer.decode(first[:-1]) == TOOL.read_text(files[0])
    assert max(max(dataset[i]) for i in range(6)) < 320


def test_cli_rejects_tiny_vocab(tmp_path):
    with pytest.raises(SystemExit):
        TOOL.main(["--output-dir", str(tmp_path), "--vocab-size", "100"])


def text_worker(rank, world, argv):
    EXAMPLE.main(argv)


def test_stand_in_trains_on_text(small_dataset, capfd):
    out, summary = small_dataset
    argv = ["--data-path", summary["data_path"], "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", str(out / "vocab.json"), "--merge-file", str(out / "merges.txt"),
            "--train-iters", "3", "--seq-length", "32", "--hidden-size", "32",
            "--global-batch-size", "2", "--micro-batch-size", "1", "--log-interval", "1",
            "--use-linear-ce-fusion-loss", "--linear-ce-fusion-chunk-size", "16",
            "--compare-unfused", "--cross-entropy-loss-fusion"]
    run_workers(text_worker, 1, argv, timeout=180)
    text = capfd.readouterr().out
    assert f"data: GPTDataset {summary['data_path']}" in text
    assert "--cross-entropy-loss-fusion: acts on materialized logits" in text
    line = next(line for line in text.splitlines() if line.startswith("first batch"))
    difference = float(re.search(r"\|difference\| ([0-9.e+-]+)", line).group(1))
    assert difference <= 1e-4, line
    losses = [float(x) for x in re.findall(r"iteration \d/3: lm loss ([0-9.]+)", text)]
    assert len(losses) == 3 and all(0 < x < 10 for x in losses), text
