"""Shared fixtures of the data tests: the real LLM-jp v3 model (if ../shared is there), a tokenizer trained once per
session on the bundled corpus, jsonl writers, and random corpora with known contents."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from tests.data.data_helpers import megatron_datasets

REPO = Path(__file__).resolve().parents[2]
LLMJP_MODEL = "data/llm-jp-tokenizer-v3/llm-jp-tokenizer-100k.ver3.0b1.model"


def shared_dir() -> Path:
    return Path(os.environ.get("LLMJP_DS_SHARED") or REPO / ".." / "shared").resolve()


@pytest.fixture(scope="session")
def llmjp_model() -> Path:
    path = shared_dir() / LLMJP_MODEL
    if not path.is_file():
        pytest.skip(f"LLM-jp v3 tokenizer not found at {path} (set LLMJP_DS_SHARED)")
    return path


@pytest.fixture(scope="session")
def trained_tokenizer(tmp_path_factory) -> Path:
    """A 2,000-piece LLM-jp-layout tokenizer trained on a sample of the bundled corpus (~4 s, once)."""
    from llmjp_ds.data import bundled_corpus_files
    from llmjp_ds.data.tokenizer import train_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    return train_tokenizer(bundled_corpus_files(), out, vocab_size=2000, max_sentences=2000, num_threads=2,
                           seed_sentencepiece_size=50000)


@pytest.fixture(scope="session")
def corpus_texts() -> list[str]:
    """Every 10th document of each bundled corpus file (Japanese, English, code)."""
    from llmjp_ds.data import bundled_corpus_files

    texts = []
    for path in bundled_corpus_files():
        with gzip.open(path, "rt", encoding="utf-8") as f:
            texts += [json.loads(line)["text"] for i, line in enumerate(f) if i % 10 == 0]
    return texts


@pytest.fixture(scope="session")
def megatron_indexed():
    """megatron-core's indexed_dataset module (the reference implementation of the format)."""
    return megatron_datasets("indexed_dataset")[0]
