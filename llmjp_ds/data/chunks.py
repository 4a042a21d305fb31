"""The units of preprocessing: chunks of jsonl lines and slices of columnar files, and the worker that tokenizes one.

jsonl is read by the main process (a compressed stream decodes in one order only) and shipped as chunks of
~1 MB of lines; a parquet or Arrow file is cut into slices (``columnar.plan_*``) that each worker reads itself, so
one large shard keeps every worker busy. Every task carries its input's index and its share of the progress
bar (compressed bytes for jsonl; for a columnar file, its rows' share of the file's size).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from llmjp_ds.data.columnar import Slice, plan_arrow, plan_parquet, read_rows
from llmjp_ds.data.inputs import Source
from llmjp_ds.data.jsonl import BadLine, iter_lines, text_of_line
from llmjp_ds.data.tokenizer import load_tokenizer
from llmjp_ds.errors import fail

ENCODE_CHARS = 1 << 18


@dataclass
class Lines:
    path: str
    first_lineno: int
    lines: list[bytes]


@dataclass
class Task:
    source: int  # index into the resolved inputs
    progress: int  # bytes of the progress bar this task completes
    piece: Lines | Slice


@dataclass
class Encoded:
    """A task's documents (framed tokens back to back, and their lengths) and what it skipped."""
    source: int
    progress: int
    flat: object = None
    lengths: object = None
    skipped: dict = field(default_factory=dict)
    first_skip: str | None = None
    error: tuple[str, str] | None = None  # (file, message): a bad line or row, without --skip-bad


def plan_columnar(sources: list[Source], chunk_bytes: int, text_key: str, skip_bad: bool) -> dict[int, list[Slice]]:
    """Slices of every columnar input, planned before any work: a truncated or corrupt file, or (without
    ``skip_bad``) one with no string column ``text_key``, fails now and not hours later."""
    plans = {}
    for i, source in enumerate(sources):
        if source.format == "jsonl":
            continue
        plan = plan_parquet if source.format == "parquet" else plan_arrow
        slices, problem = plan(source.path, chunk_bytes, text_key)
        if problem is not None and not skip_bad and any(s.rows for s in slices):
            fail(f"{source.path}: {problem}, or pass --skip-bad to skip such rows")
        plans[i] = slices
    return plans


def tasks(sources: list[Source], plans: dict[int, list[Slice]], chunk_bytes: int) -> Iterator[Task]:
    """Every task of every input, in input order."""
    for i, source in enumerate(sources):
        if source.format != "jsonl":
            size, total = source.path.stat().st_size, sum(s.rows for s in plans[i]) or 1
            done = 0
            for piece in plans[i]:
                share = size * (done + piece.rows) // total - size * done // total
                done += piece.rows
                yield Task(i, share, piece)
            continue
        yield from _line_chunks(i, source.path, chunk_bytes)


def _line_chunks(index: int, path: Path, chunk_bytes: int) -> Iterator[Task]:
    lines: list[bytes] = []
    size, first, last_raw = 0, 1, 0
    for lineno, line, raw_pos in iter_lines(path):
        if not lines:
            first = lineno
        lines.append(line)
        size += len(line)
        if size >= chunk_bytes:
            yield Task(index, raw_pos - last_raw, Lines(str(path), first, lines))
            last_raw = raw_pos
            lines, size = [], 0
    yield Task(index, path.stat().st_size - last_raw, Lines(str(path), first, lines))


def _jsonl_rows(piece: Lines, text_key: str) -> Iterator[tuple[int, object]]:
    for n, line in enumerate(piece.lines):
        try:
            text = text_of_line(line, text_key)
        except BadLine as bad:
            text = bad
        if text is not None:
            yield piece.first_lineno + n, text


class ChunkEncoder:
    """What a tokenizing worker runs: one :class:`Task` -> :class:`Encoded`.

    Picklable and small (the tokenizer's path and the options); the tokenizer and an open parquet file are
    loaded on first use and kept on the object, so each worker process loads them once."""

    def __init__(self, model_path: str, text_key: str, skip_bad: bool):
        self.model_path, self.text_key, self.skip_bad = model_path, text_key, skip_bad
        self._tok = None
        self._files: dict = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tok": None, "_files": {}}

    @property
    def tok(self):
        if self._tok is None:
            self._tok = load_tokenizer(self.model_path)
        return self._tok

    def __call__(self, task: Task) -> Encoded:
        piece, out = task.piece, Encoded(task.source, task.progress)
        if isinstance(piece, Slice):
            rows, unit = read_rows(piece, self.text_key, self._files), "rows"
            where = lambda n: f"{piece.path}: row {n}"  # noqa: E731
        else:
            rows, unit = _jsonl_rows(piece, self.text_key), "lines"
            where = lambda n: f"{piece.path}:{n}"  # noqa: E731

        def bad(n: int, why: BadLine) -> bool:
            """Count a bad row, or record the error; True if the task must stop."""
            if not self.skip_bad:
                out.error = (piece.path, f"{where(n)}: {why}, or pass --skip-bad to skip such {unit}")
                return True
            out.skipped[why.kind] = out.skipped.get(why.kind, 0) + 1
            out.first_skip = out.first_skip or f"{where(n)}: {why}"
            return False

        # encoded in groups of ~ENCODE_CHARS: a row group of 100 MB never becomes one list of Python ints
        texts, numbers, parts, size = [], [], [], 0
        for n, text in rows:
            if isinstance(text, BadLine):
                if bad(n, text):
                    return out
                continue
            texts.append(text)
            numbers.append(n)
            size += len(text)
            if size >= ENCODE_CHARS:
                parts.append(self._encode(texts, numbers, bad))
                texts, numbers, size = [], [], 0
        parts.append(self._encode(texts, numbers, bad))
        if out.error is None:
            out.flat = np.concatenate([flat for flat, _ in parts])
            out.lengths = np.concatenate([lengths for _, lengths in parts])
        return out

    def _encode(self, texts: list[str], numbers: list[int], bad):
        try:
            return self.tok.encode_documents(texts)
        except Exception:  # a text the tokenizer rejects: find it, and treat it as a bad line
            pass
        kept = []
        for n, text in zip(numbers, texts):
            try:
                self.tok.encode_documents([text])
            except Exception as exc:
                why = BadLine("unencodable text", f"the tokenizer cannot encode {self.text_key!r} "
                                                  f"({type(exc).__name__}: {exc}); fix or remove the line")
                if bad(n, why):
                    break
                continue
            kept.append(text)
        return self.tok.encode_documents(kept)
