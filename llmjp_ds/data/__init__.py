"""The data layer: jsonl / parquet / Arrow -> SentencePiece ids -> Megatron .bin/.idx -> shuffled, blended windows.

* :mod:`.tokenizer`: train / load SentencePiece models (LLM-jp v3 layout), save them as HF tokenizers;
* :mod:`.inputs`: ``--input`` as files, directories and globs -> ordered jsonl / parquet / Arrow sources;
* :mod:`.jsonl`: read jsonl / .gz / .zst / .bz2 / .xz, and say exactly which line is bad;
* :mod:`.columnar`: parquet and Arrow IPC (``datasets.save_to_disk``) with pyarrow: plan into slices, read a slice;
* :mod:`.chunks`: the units of preprocessing and the worker that tokenizes one;
* :mod:`.pool`: an ordered process pool (results in input order, bounded in flight);
* :mod:`.preprocess`: ``llmjp-ds preprocess``: inputs -> PREFIX_text_document.bin/.idx + .json (parallel, atomic);
* :mod:`.indexed`: the Megatron MMIDIDX format: IndexedDataset (reader), IndexedDatasetWriter;
* :mod:`.dataset`: GPT windows of seq_len + 1 tokens, per-epoch shuffles, weighted blends, cached indices;
* :mod:`.megatron_order`: ``data.order: megatron``, Megatron-LM's samples from megatron-core's own dataset code;
* :mod:`.megatron_internals`: every use of megatron-core beyond its public dataset API;
* :mod:`.batch_schedule`: the global batch of each step, as Megatron-LM's microbatch calculator gives it (pure);
* :mod:`.batching`: which samples each rank reads of a step, and the steps whose samples are read and not trained
  on (pure);
* :mod:`.phases`: the samples a run reads, phase by phase (a decay branch's other blend, a mid-training phase);
* :mod:`.plan`: what a run reads: the configured blend and tokenizer, or the bundled corpus prepared once;
* ``corpus/``: the bundled demo corpus (ja, en, code); regenerate with ``python -m benchmarks.corpus_gen``.

Names below import lazily so that ``import llmjp_ds.data`` stays cheap. ``preprocess`` is not among them: the name
is its module's (use ``from llmjp_ds.data.preprocess import preprocess``).
"""

from __future__ import annotations

import importlib
from pathlib import Path

from llmjp_ds.errors import fail

CORPUS_DIR = Path(__file__).resolve().parent / "corpus"

_LAZY = {
    "IndexedDataset": "indexed", "IndexedDatasetWriter": "indexed", "best_dtype": "indexed",
    "Tokenizer": "tokenizer", "load_tokenizer": "tokenizer", "train_tokenizer": "tokenizer",
    "save_hf_tokenizer": "tokenizer",
    "parse_blend": "dataset", "build_datasets": "dataset", "SampleDataset": "dataset",
}
__all__ = ["CORPUS_DIR", "bundled_corpus_files", *_LAZY]


def bundled_corpus_files() -> list[Path]:
    """The demo corpus shipped with the package: Japanese, English (incl. stdlib docstrings) and Python code."""
    files = [CORPUS_DIR / f"{name}.jsonl.gz" for name in ("ja", "en", "code")]
    missing = [f for f in files if not f.exists()]
    if missing:
        fail(f"bundled corpus file {missing[0]} is missing: reinstall llmjp-ds, or regenerate it with "
             f"`python -m benchmarks.corpus_gen` in a repository checkout")
    return files


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"llmjp_ds.data.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'llmjp_ds.data' has no attribute {name!r}")
