"""A large real-text corpus from text already on a machine: the Python sources (code and docstrings) of its
installed packages and standard library, for FP8 fidelity runs that must not memorise their data.

    python benchmarks/real_text_corpus.py --output-dir DIR --tokenizer LLM_JP_V3_MODEL [--megabytes 250] [--parts K]

Writes ``DIR/sources.jsonl`` (one document per source file, in a fixed order, up to ``--megabytes`` of text;
with ``--parquet`` also ``DIR/sources.parquet``, the same documents in row groups of ~``--row-group-mb``)
and preprocesses it with ``llmjp-ds preprocess`` into ``DIR/python_text_document.{bin,idx}``; prints the blend
prefix. With ``--parts K`` the documents are dealt in turn into K corpora instead, ``DIR/python-1_text_document``
.. ``python-K``: a blend of K datasets, none of which repeats before the whole does. The bundled demo corpus
cannot serve here: it is a few MB, which a small model learns by heart within a few hundred steps, and the FP8
penalty then measures the precision of memorisation (docs/precision.md).
Not shipped: it only runs where the evidence is gathered (run P of docs/precision.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path


def source_files() -> list[Path]:
    """Every ``.py`` file under the interpreter's library directories, sorted (the same order on every run)."""
    roots = {Path(sysconfig.get_paths()[key]) for key in ("stdlib", "purelib", "platlib")}
    roots |= {Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()}
    files = set()
    for root in roots:
        files.update(p for p in root.rglob("*.py") if p.is_file())
    return sorted(files)


def write_jsonl(path: Path, budget_bytes: int) -> tuple[int, int]:
    """(documents, bytes) written: the source files' texts until the budget is reached."""
    docs = size = 0
    with open(path, "w", encoding="utf-8") as out:
        for f in source_files():
            try:
                text = f.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if not text.strip():
                continue
            out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            docs, size = docs + 1, size + len(text.encode())
            if size >= budget_bytes:
                break
    return docs, size


def write_parquet_copy(jsonl: Path, parquet: Path, row_group_mb: float = 8.0) -> int:
    """The documents of ``jsonl`` as a parquet file with one ``text`` column (snappy), in row groups of about
    ``row_group_mb`` of text, as hub shards are; returns the number of row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    budget = int(row_group_mb * 2**20)
    schema = pa.schema([("text", pa.string())])
    groups = 0
    with open(jsonl, encoding="utf-8") as src, pq.ParquetWriter(str(parquet), schema, compression="snappy") as out:
        texts, size = [], 0
        for line in src:
            texts.append(json.loads(line)["text"])
            size += len(texts[-1].encode())
            if size >= budget:
                out.write_table(pa.table({"text": texts}, schema=schema), row_group_size=len(texts))
                texts, size, groups = [], 0, groups + 1
        if texts:
            out.write_table(pa.table({"text": texts}, schema=schema), row_group_size=len(texts))
            groups += 1
    return groups


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-dir", required=True)
    p.add_argument("--tokenizer", required=True, help="SentencePiece .model (the LLM-jp v3 tokenizer)")
    p.add_argument("--megabytes", type=float, default=250.0)
    p.add_argument("--workers", type=int, default=max(1, min(14, os.cpu_count() or 1)))
    p.add_argument("--parquet", action="store_true", help="also write DIR/sources.parquet (the same documents)")
    p.add_argument("--row-group-mb", type=float, default=8.0)
    p.add_argument("--parts", type=int, default=1, help="deal the documents into this many corpora")
    a = p.parse_args(argv)
    if a.parts < 1:
        p.error(f"--parts {a.parts}: give 1 or more corpora to deal the documents into")
    out = Path(a.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    docs, size = write_jsonl(out / "sources.jsonl", int(a.megabytes * 2**20))
    print(f"{docs} source files, {size / 2**20:.0f} MB of text", flush=True)
    if a.parquet:
        groups = write_parquet_copy(out / "sources.jsonl", out / "sources.parquet", a.row_group_mb)
        print(f"{out / 'sources.parquet'}: the same documents in {groups} row groups", flush=True)
    names = {"sources.jsonl": "python"} if a.parts == 1 else deal(out / "sources.jsonl", a.parts)
    for source, name in names.items():
        subprocess.run([sys.executable, "-m", "llmjp_ds.cli", "preprocess", "--input", str(out / source),
                        "--tokenizer", a.tokenizer, "--output-prefix", str(out / name), "--workers", str(a.workers),
                        "--force"], check=True)
        print(f"blend prefix: {out / name}_text_document", flush=True)


def deal(jsonl: Path, parts: int) -> dict[str, str]:
    """The documents of ``jsonl`` (``sources.jsonl``) dealt in turn into ``sources-1.jsonl`` .. ``sources-K.jsonl``
    beside it: {file: corpus name}."""
    names = {f"{jsonl.stem}-{i}.jsonl": f"python-{i}" for i in range(1, parts + 1)}
    with contextlib.ExitStack() as stack:
        outs = [stack.enter_context(open(jsonl.parent / f, "w", encoding="utf-8")) for f in names]
        with open(jsonl, encoding="utf-8") as src:
            for i, line in enumerate(src):
                outs[i % parts].write(line)
    return names


if __name__ == "__main__":
    main()
