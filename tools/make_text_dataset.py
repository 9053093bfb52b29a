"""Real text on any machine: a byte-level BPE tokenizer trained on the Python standard library's own
.py sources, and those sources as a Megatron indexed dataset.

    python tools/make_text_dataset.py --output-dir /tmp/stdlib_text            # vocab 32768
    python tools/make_text_dataset.py --output-dir /tmp/small --vocab-size 512 --max-files 40

writes, under --output-dir:

    text_document.bin / .idx   megatron-core's IndexedDataset (one document per source file, each
                               ended by <|endoftext|>): Megatron-LM's --data-path <dir>/text_document
    vocab.json / merges.txt    GPT-2 style BPE files: --tokenizer-type GPT2BPETokenizer
                               --vocab-file <dir>/vocab.json --merge-file <dir>/merges.txt
    tokenizer.json, tokenizer_config.json, special_tokens_map.json
                               a local Hugging Face tokenizer folder: --tokenizer-type
                               HuggingFaceTokenizer --tokenizer-model <dir> (no network needed)
    dataset.json               what was built: files, bytes, tokens, vocab size, <|endoftext|> id

The text is the set of `*.py` files under `sysconfig.get_paths()["stdlib"]` (site-packages left
out), in sorted path order, so a given Python version always yields the same dataset. Needs the
`tokenizers` package (`pip install megatron_fused_ce[data]`) and megatron-core.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

EOD = "<|endoftext|>"
PREFIX = "text_document"


def stdlib_sources(max_files=None, max_bytes=None):
    """Sorted `*.py` files of this interpreter's standard library (no site-packages)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in root.rglob("*.py")
                   if not {"site-packages", "dist-packages", "__pycache__"} & set(f.parts)
                   and f.is_file())
    chosen, total = [], 0
    for f in files:
        if max_files is not None and len(chosen) >= max_files:
            break
        size = f.stat().st_size
        if size == 0:
            continue
        if max_bytes is not None and total + size > max_bytes and chosen:
            break
        chosen.append(f)
        total += size
    return root, chosen


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(texts, vocab_size, min_frequency=2):
    from tokenizers import ByteLevelBPETokenizer

    tokenizer = ByteLevelBPETokenizer(add_prefix_space=False)
    tokenizer.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=[EOD], show_progress=False)
    return tokenizer


def write_tokenizer_files(tokenizer, out: Path, max_length: int = 1 << 20):
    """vocab.json + merges.txt (GPT-2 format) and a local Hugging Face tokenizer folder."""
    tokenizer.save_model(str(out))  # vocab.json, merges.txt
    tokenizer.save(str(out / "tokenizer.json"))
    special = {"bos_token": EOD, "eos_token": EOD, "unk_token": EOD}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=1) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "model_max_length": max_length,
         "add_prefix_space": False, "add_bos_token": False, **special}, indent=1) + "\n")


def write_indexed_dataset(tokenizer, texts, prefix: str, eod_id: int, batch: int = 64):
    """One document per text, `<|endoftext|>` appended; uint16 tokens where the vocab fits."""
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    dtype = numpy.uint16 if tokenizer.get_vocab_size() <= numpy.iinfo(numpy.uint16).max + 1 \
        else numpy.int32
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    tokens = documents = 0
    for begin in range(0, len(texts), batch):
        for encoding in tokenizer.encode_batch(texts[begin:begin + batch]):
            ids = encoding.ids + [eod_id]
            builder.add_document(numpy.asarray(ids, dtype=numpy.int64), [len(ids)])
            tokens += len(ids)
            documents += 1
    builder.finalize(prefix + ".idx")
    return tokens, documents, numpy.dtype(dtype).name


def build(output_dir, vocab_size=32768, max_files=None, max_bytes=None, min_frequency=2,
          quiet=False):
    """Build everything under `output_dir`; returns the dataset.json summary (a dict)."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    root, files = stdlib_sources(max_files, max_bytes)
    if not files:
        raise SystemExit(f"no .py files found under {root}")
    texts = [read_text(f) for f in files]
    tokenizer = train_tokenizer(texts, vocab_size, min_frequency)
    trained = time.time()
    write_tokenizer_files(tokenizer, out)
    eod_id = tokenizer.token_to_id(EOD)
    prefix = str(out / PREFIX)
    tokens, documents, dtype = write_indexed_dataset(tokenizer, texts, prefix, eod_id)
    summary = {
        "source": str(root), "python": sys.version.split()[0], "files": len(files),
        "bytes": sum(len(t.encode("utf-8")) for t in texts), "documents": documents,
        "tokens": tokens, "vocab_size": tokenizer.get_vocab_size(), "requested_vocab_size": vocab_size,
        "eod_token": EOD, "eod_id": eod_id, "token_dtype": dtype, "data_path": prefix,
        "vocab_file": str(out / "vocab.json"), "merge_file": str(out / "merges.txt"),
        "tokenizer_model": str(out), "train_seconds": round(trained - start, 2),
        "total_seconds": round(time.time() - start, 2),
    }
    (out / "dataset.json").write_text(json.dumps(summary, indent=1) + "\n")
    if not quiet:
        print(f"{len(files)} files ({summary['bytes'] / 1e6:.1f} MB) from {root}: "
              f"{tokens} tokens, vocab {summary['vocab_size']} ({EOD} = {eod_id}), "
              f"{summary['total_seconds']} s -> {prefix}.bin/.idx", flush=True)
    return summary


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--vocab-size", type=int, default=32768,
                        help="BPE vocabulary size, <|endoftext|> included (default 32768)")
    parser.add_argument("--max-files", type=int, default=None,
                        help="use only the first N files (sorted paths)")
    parser.add_argument("--max-bytes", type=int, default=None,
                        help="stop adding files past this many bytes of text")
    parser.add_argument("--min-frequency", type=int, default=2)
    args = parser.parse_args(argv)
    if args.vocab_size < 257:
        parser.error("--vocab-size must be at least 257 (256 bytes + <|endoftext|>)")
    build(args.output_dir, args.vocab_size, args.max_files, args.max_bytes, args.min_frequency)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    main()
