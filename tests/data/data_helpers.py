"""Helpers of the data tests: tricky strings, jsonl writers, corpora with known contents."""

from __future__ import annotations

import gzip
import importlib
import json
import warnings
from pathlib import Path

import numpy as np
import pytest

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


# --- columnar files, written by pyarrow itself ---------------------------------------------------------------

def _table(records, text_key: str = "text", large: bool = False):
    import pyarrow as pa

    texts = [r.get(text_key) if isinstance(r, dict) else r for r in records]
    columns = {text_key: pa.array(texts, type=pa.large_string() if large else pa.string()),
               "id": pa.array(range(len(texts)), type=pa.int64())}
    return pa.table(columns)


def write_parquet(path: Path, records, row_group_size: int = 50, compression: str = "snappy",
                  large: bool = False, text_key: str = "text") -> Path:
    """``records`` (dicts with a text key, or texts; None is a null) as parquet, with an extra ``id`` column."""
    import pyarrow.parquet as pq

    pq.write_table(_table(records, text_key, large), path, row_group_size=row_group_size, compression=compression)
    return path


def write_arrow_stream(path: Path, table, batch_rows: int = 1000, metadata: dict | None = None) -> Path:
    import pyarrow as pa

    schema = table.schema.with_metadata(metadata or {})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for batch in table.to_batches(max_chunksize=batch_rows):
            writer.write_batch(batch)
    return path


def write_saved_dataset(directory: Path, records, shards: int = 2, batch_rows: int = 1000) -> Path:
    """What ``datasets.Dataset.save_to_disk(directory, num_shards=shards)`` writes: ``data-0000i-of-0000n.arrow``
    (Arrow IPC *stream* format, record batches of ``writer_batch_size`` = 1000 rows, the features in the schema's
    ``huggingface`` metadata), ``dataset_info.json`` (the features) and ``state.json`` (the shards in order)."""
    table = _table(records)
    directory.mkdir(parents=True)
    features = {"text": {"dtype": "string", "_type": "Value"}, "id": {"dtype": "int64", "_type": "Value"}}
    meta = {"huggingface": json.dumps({"info": {"features": features}})}
    names, n = [], table.num_rows
    bounds = [n * i // shards for i in range(shards + 1)]
    for i in range(shards):
        name = f"data-{i:05d}-of-{shards:05d}.arrow"
        write_arrow_stream(directory / name, table.slice(bounds[i], bounds[i + 1] - bounds[i]), batch_rows, meta)
        names.append(name)
    (directory / "dataset_info.json").write_text(json.dumps({"citation": "", "description": "", "features": features,
                                                              "homepage": "", "license": ""}, indent=2))
    (directory / "state.json").write_text(json.dumps({
        "_data_files": [{"filename": name} for name in names], "_fingerprint": "0123456789abcdef",
        "_format_columns": None, "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False,
        "_split": None}, indent=2, sort_keys=True))
    return directory


def megatron_datasets(*names: str) -> list:
    """megatron-core's ``megatron.core.datasets.<name>`` modules (imported quietly), or skip the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return [importlib.import_module(f"megatron.core.datasets.{name}") for name in names]
        except ImportError as exc:
            pytest.skip(f"megatron-core not importable: {exc}")
