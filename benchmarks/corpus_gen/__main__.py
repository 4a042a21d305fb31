"""Regenerate ``llmjp_ds/data/corpus/{ja,en,code}.jsonl.gz``: ``python -m benchmarks.corpus_gen [--out DIR]``
(from the repository root).

Deterministic: the same seed and the same CPython standard library (the committed files used 3.11.7) give the
same bytes (gzip mtime is fixed at 0).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
from pathlib import Path

from benchmarks.corpus_gen import code, english, japanese

CORPUS_DIR = Path(__file__).resolve().parents[2] / "llmjp_ds" / "data" / "corpus"


def write_jsonl_gz(path: Path, texts: list[str]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0, filename="") as gz:
        for text in texts:
            gz.write((json.dumps({"text": text}, ensure_ascii=False) + "\n").encode("utf-8"))
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.corpus_gen", description=__doc__)
    parser.add_argument("--out", type=Path, default=CORPUS_DIR)
    parser.add_argument("--seed", type=int, default=20240601)
    parser.add_argument("--ja-docs", type=int, default=6000)
    parser.add_argument("--en-docs", type=int, default=3000)
    parser.add_argument("--code-chars", type=int, default=900_000)
    parser.add_argument("--docstring-chars", type=int, default=350_000)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    ja = japanese.documents(args.ja_docs, args.seed)
    en = english.documents(args.en_docs, args.seed + 1) + code.docstring_documents(args.docstring_chars)
    random.Random(args.seed + 2).shuffle(en)
    py = code.code_documents(args.code_chars)
    for name, texts in (("ja", ja), ("en", en), ("code", py)):
        path = args.out / f"{name}.jsonl.gz"
        write_jsonl_gz(path, texts)
        chars = sum(map(len, texts))
        print(f"{path}: {len(texts)} documents, {chars:,} characters, {path.stat().st_size:,} bytes",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
