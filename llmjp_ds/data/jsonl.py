"""Reading jsonl corpora (plain, .gz, .zst): open by content, iterate lines, pull the text out of each line.

One place decides what a bad line is, so ``preprocess`` and ``train-tokenizer`` report it the same way.
"""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path
from typing import BinaryIO, Iterator

from llmjp_ds.errors import fail

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


class BadLine(Exception):
    """A line that is not a json object with a string under the text key. ``kind`` groups the skip counts."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def check_inputs(inputs) -> list[Path]:
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    paths = [Path(p) for p in inputs]
    if not paths:
        fail("no input files given: pass one or more jsonl files (plain, .gz or .zst) with --input")
    for p in paths:
        if p.is_dir():
            fail(f"input {p} is a directory: pass the jsonl files inside it (e.g. {p}/*.jsonl)")
        if not p.exists():
            fail(f"input {p} not found: check the path (jsonl, .jsonl.gz or .jsonl.zst)")
    return paths


def open_binary(path: Path) -> tuple[BinaryIO, BinaryIO]:
    """(decompressed stream, raw file) for ``path``; the raw file's position measures progress."""
    raw = open(path, "rb")
    magic = raw.read(4)
    raw.seek(0)
    if magic[:2] == GZIP_MAGIC:
        return gzip.GzipFile(fileobj=raw, mode="rb"), raw
    if magic == ZSTD_MAGIC:
        import zstandard

        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        return io.BufferedReader(reader, buffer_size=1 << 20), raw
    return raw, raw


def iter_lines(path: Path) -> Iterator[tuple[int, bytes, int]]:
    """(1-based line number, line bytes, compressed bytes read so far) for every line of a jsonl file."""
    stream, raw = open_binary(path)
    try:
        lineno = 0
        while True:
            try:
                line = stream.readline()
            except (OSError, EOFError, gzip.BadGzipFile) as exc:
                fail(f"{path}:{lineno + 1}: cannot decompress ({exc}): the file is truncated or corrupt; "
                     f"re-download or re-compress it")
            except Exception as exc:  # zstandard.ZstdError
                fail(f"{path}:{lineno + 1}: cannot decompress ({type(exc).__name__}: {exc}): the file is "
                     f"truncated or corrupt; re-download or re-compress it")
            if not line:
                return
            lineno += 1
            yield lineno, line, raw.tell()
    finally:
        stream.close()
        raw.close()


def text_of_line(line: bytes, text_key: str) -> str | None:
    """The document text of one jsonl line; ``None`` for a blank line; ``BadLine`` for anything else."""
    line = line.rstrip(b"\r\n")
    if not line.strip():
        return None
    try:
        decoded = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadLine("invalid UTF-8", f"invalid UTF-8 at byte {exc.start}; re-encode the file as UTF-8") from None
    try:
        record = json.loads(decoded)
    except json.JSONDecodeError as exc:
        raise BadLine("invalid JSON", f"invalid JSON ({exc.msg}, column {exc.colno}); fix or remove the line") \
            from None
    if not isinstance(record, dict):
        raise BadLine("not an object", f"line is a JSON {type(record).__name__}, not an object with a "
                                       f"{text_key!r} key; write one object per line")
    if text_key not in record:
        keys = ", ".join(list(map(str, record))[:6]) or "none"
        raise BadLine(f"no {text_key!r} key", f"no {text_key!r} key (keys: {keys}); pick the key with --text-key")
    text = record[text_key]
    if not isinstance(text, str):
        raise BadLine(f"non-string {text_key!r}", f"{text_key!r} is a JSON {type(text).__name__}, not a string; "
                                                   f"store the document text as one string")
    return text


def iter_documents(inputs, text_key: str = "text", skip_bad: bool = False) -> Iterator[tuple[Path, int, str]]:
    """(file, line number, text) for every document; a bad line raises a one-line UserError unless skipped."""
    for path in check_inputs(inputs):
        for lineno, line, _ in iter_lines(path):
            try:
                text = text_of_line(line, text_key)
            except BadLine as bad:
                if skip_bad:
                    continue
                fail(f"{path}:{lineno}: {bad}, or pass --skip-bad to skip such lines")
            if text is not None:
                yield path, lineno, text
