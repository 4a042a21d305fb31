"""Helpers of the data tests: tricky strings, jsonl writers, corpora with known contents."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np

# strings where tokenizers usually disagree: whitespace runs, leading spaces, emoji, code, mixed scripts
TRICKY = [
    "こんにちは、世界！今日は良い天気ですね。", "日本語の文章と English mixed テキスト。", "Hello world", "  leading spaces",
    "trailing   ", "a  b   c    d", "\tdef f(x):\n\t\treturn x  # comment\n\n\n", "    indented\n        more\n",
    "emoji 😀👍🏽 and 🇯🇵 flags", "", " ", "\n", "\n\nnewlines first", "東京都千代田区1-2-3\r\nline2",
    "数字12345678と全角１２３", "\u3000全角スペース\u3000", "Ω≈ç√∫˜µ≤≥÷", "combining e\u0301 ＡＢＣ ｶﾀｶﾅ",
    "for i in range(10):\n    print(i ** 2)  # squares\n", "x = {'a': [1, 2, 3]}\n\n\n\nif x:\n\tpass",
    "未知の漢字：鬱龘𠮷野家", "URL https://example.com/a?b=c&d=e#f", "tab\tseparated\tvalues\t\t",
]


def write_jsonl(path: Path, records, compress: str | None = None) -> Path:
    """Write records (dicts, or raw str/bytes lines) as jsonl, optionally .gz or .zst."""
    lines = []
    for r in records:
        if isinstance(r, bytes):
            lines.append(r)
        elif isinstance(r, str):
            lines.append(r.encode())
        else:
            lines.append(json.dumps(r, ensure_ascii=False).encode())
    data = b"\n".join(lines) + b"\n"
    if compress == "gz":
        data = gzip.compress(data, mtime=0)
    elif compress == "zst":
        import zstandard

        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return path


def random_documents(rng: np.random.Generator, n: int, high: int, max_len: int = 200) -> list[np.ndarray]:
    return [rng.integers(0, high, size=int(rng.integers(0, max_len))) for _ in range(n)]


def write_corpus(prefix: Path, docs, dtype=np.uint16) -> str:
    from llmjp_ds.data.indexed import IndexedDatasetWriter

    with IndexedDatasetWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(d)
    return str(prefix)


def labelled_corpus(prefix: Path, lengths, label_base: int = 10) -> str:
    """A corpus whose document d is ``len`` copies of ``label_base + d``: every sample says where it came from."""
    return write_corpus(prefix, [np.full(n, label_base + d, dtype=np.int64) for d, n in enumerate(lengths)])
