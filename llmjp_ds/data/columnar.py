"""Columnar corpora: parquet files and Arrow IPC shards (what ``datasets.save_to_disk`` writes), read with pyarrow.

A file is first *planned* in the main process: its footer (parquet) or its stream of record batches (Arrow,
memory-mapped, so only the batches' headers are read) is checked whole, and cut into :class:`Slice` s of about a
chunk's worth of text: whole row groups (parquet) or runs of record batches (Arrow). A truncated or corrupt file
fails here, before any work, with one line naming it. Workers then read their slices themselves, only the text
column, so a large shard is tokenized by every worker at once and memory stays at about a row group per worker.

``read_rows`` yields ``(row number, text)`` with a :class:`~llmjp_ds.data.jsonl.BadLine` in place of the text
where the row has none (a missing or non-string column, a null): the same kinds, and the same ``--skip-bad``
counts, as bad jsonl lines. An empty string is a document, as ``{"text": ""}`` is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from llmjp_ds.data.jsonl import BadLine
from llmjp_ds.errors import fail

PARQUET_MAGIC = b"PAR1"
ARROW_FILE_MAGIC = b"ARROW1"
ARROW_STREAM_CONTINUATION = b"\xff\xff\xff\xff"
ARROW_EOS = ARROW_STREAM_CONTINUATION + b"\x00\x00\x00\x00"  # what a stream writer's close() appends
_BATCH_ROWS = 1024  # rows turned into Python strings at a time
SPLIT = 4  # at most this many slices per parquet row group (each worker reading one decodes the whole group)


@dataclass(frozen=True)
class Slice:
    """Part of one columnar file: rows ``[start, stop)`` of parquet row group ``group``, or Arrow record batches
    ``[start, stop)``; its first row is row ``first_row`` of the file."""
    path: str
    format: str  # "parquet" | "arrow"
    start: int
    stop: int
    first_row: int
    rows: int
    group: int = -1


def _pyarrow():
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        fail("reading parquet or Arrow files needs pyarrow: pip install pyarrow")
    import pyarrow.ipc
    import pyarrow.parquet

    return pyarrow


def _unreadable(path, what: str, exc: Exception) -> None:
    msg = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    fail(f"{path} is not a readable {what} ({msg}): the file is truncated or corrupt (an interrupted download or "
         f"copy?); re-fetch it, or write it again")


def plan_parquet(path: Path, chunk_bytes: int, text_key: str) -> tuple[list[Slice], BadLine | None]:
    """Slices of row groups: a row group of ``B`` uncompressed bytes is cut into ``min(SPLIT, B / chunk_bytes)``
    runs of rows, so that a file of a few large row groups still feeds every worker; and what is wrong with the
    file's text column (None if nothing)."""
    pa = _pyarrow()
    try:
        pf = pa.parquet.ParquetFile(path)
        meta = pf.metadata
        problem = _column_problem(pa, pf.schema_arrow, text_key)
    except (pa.ArrowException, OSError) as exc:
        _unreadable(path, "parquet file", exc)
    slices, first = [], 0
    for g in range(meta.num_row_groups):
        rows = meta.row_group(g).num_rows
        pieces = max(1, min(SPLIT, rows, -(-meta.row_group(g).total_byte_size // chunk_bytes)))
        bounds = [rows * k // pieces for k in range(pieces + 1)]
        slices += [Slice(str(path), "parquet", bounds[k], bounds[k + 1], first + bounds[k], bounds[k + 1] - bounds[k],
                         g) for k in range(pieces)]
        first += rows
    return slices, problem


def _open_arrow(pa, source):
    """A record-batch reader over a memory-mapped Arrow file, IPC file format (``ARROW1``) or stream format."""
    head = source.read(len(ARROW_FILE_MAGIC))
    source.seek(0)
    if head == ARROW_FILE_MAGIC:
        reader = pa.ipc.open_file(source)
        return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))
    reader = pa.ipc.open_stream(source)
    return reader.schema, iter(reader)


def plan_arrow(path: Path, chunk_bytes: int, text_key: str) -> tuple[list[Slice], BadLine | None]:
    """Slices of consecutive record batches up to ``chunk_bytes``. The whole stream is walked (headers only: the
    file is memory-mapped and batches are not copied), and it must end with the stream's end-of-stream marker:
    a shard cut at a batch boundary would otherwise read as a shorter dataset without a word."""
    pa = _pyarrow()
    slices, start, first, rows, size, n = [], 0, 0, 0, 0, 0
    try:
        with pa.memory_map(str(path)) as source:
            stream = source.read_at(len(ARROW_FILE_MAGIC), 0) != ARROW_FILE_MAGIC
            schema, batches = _open_arrow(pa, source)
            problem = _column_problem(pa, schema, text_key)
            end = source.tell()  # where the last message read ends
            for n, batch in enumerate(batches, 1):
                end = source.tell()
                batch.validate()
                rows += batch.num_rows
                size += batch.nbytes
                if size >= chunk_bytes:
                    slices.append(Slice(str(path), "arrow", start, n, first, rows))
                    start, first, rows, size = n, first + rows, 0, 0
            complete = not stream or (source.size() == end + len(ARROW_EOS) and
                                      source.read_at(len(ARROW_EOS), end) == ARROW_EOS)
    except (pa.ArrowException, OSError) as exc:
        _unreadable(path, "Arrow file", exc)
    if not complete:
        fail(f"{path} ends without the Arrow stream's end-of-stream marker (truncated after {first + rows:,} rows: an "
             f"interrupted download or copy?): re-fetch it, or save the dataset again")
    if n > start:
        slices.append(Slice(str(path), "arrow", start, n, first, rows))
    return slices, problem


def is_string_type(pa, t) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or getattr(pa.types, "is_string_view",
                                                                           lambda _: False)(t)


def _column_problem(pa, schema, text_key: str) -> BadLine | None:
    """The BadLine every row of a file gets when its schema has no string column ``text_key``, else None."""
    if text_key not in schema.names:
        names = ", ".join(schema.names[:6]) or "none"
        return BadLine(f"no {text_key!r} key", f"no {text_key!r} column (columns: {names}); pick the column with "
                                               f"--text-key")
    t = schema.field(text_key).type
    if not is_string_type(pa, t):
        return BadLine(f"non-string {text_key!r}", f"column {text_key!r} holds {t}, not strings; store the "
                                                   f"document text as a string column")
    return None


def _texts(rows: Iterator, problem: BadLine | None, first_row: int, text_key: str) -> Iterator[tuple[int, object]]:
    null = BadLine(f"non-string {text_key!r}", f"{text_key!r} is null, not a string; store the document text as one "
                                                f"string")
    row = first_row
    for column in rows:
        if problem is not None:
            for _ in range(len(column)):
                yield row, problem
                row += 1
            continue
        for text in column.to_pylist():
            yield row, null if text is None else text
            row += 1


def read_rows(piece: Slice, text_key: str, cache: dict) -> Iterator[tuple[int, object]]:
    """``(row, text or BadLine)`` for every row of ``piece``. ``cache`` keeps an open parquet file per worker."""
    pa = _pyarrow()
    try:
        if piece.format == "parquet":
            yield from _parquet_rows(pa, piece, text_key, cache)
        else:
            yield from _arrow_rows(pa, piece, text_key)
    except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:
        what = f"row group {piece.group}" if piece.format == "parquet" else \
            f"record batches {piece.start}-{piece.stop - 1}"
        msg = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        fail(f"{piece.path}: {what} cannot be read ({msg}): the file is corrupt; re-fetch it, or write it again")


def _parquet_rows(pa, piece: Slice, text_key: str, cache: dict):
    """The slice's rows; ``cache`` keeps the open file and the last row group's text column (one per worker)."""
    if cache.get("path") != piece.path:
        cache.clear()
        cache.update(path=piece.path, file=pa.parquet.ParquetFile(piece.path))
    pf = cache["file"]
    problem = _column_problem(pa, pf.schema_arrow, text_key)
    if problem is not None:
        columns = iter([[None] * piece.rows])
    else:
        if cache.get("group") != piece.group:
            cache["column"] = pf.read_row_group(piece.group, columns=[text_key], use_threads=False).column(0)
            cache["group"] = piece.group
        column = cache["column"].slice(piece.start, piece.rows)
        columns = (column.slice(at, _BATCH_ROWS) for at in range(0, piece.rows, _BATCH_ROWS))
    yield from _texts(columns, problem, piece.first_row, text_key)


def _arrow_rows(pa, piece: Slice, text_key: str):
    with pa.memory_map(piece.path) as source:
        schema, batches = _open_arrow(pa, source)
        problem = _column_problem(pa, schema, text_key)

        def columns():
            for i, batch in enumerate(batches):
                if i >= piece.stop:
                    return
                if i >= piece.start:
                    if problem is not None:
                        yield [None] * batch.num_rows
                        continue
                    column = batch.column(schema.get_field_index(text_key))
                    column.validate(full=True)  # offsets inside the buffers, valid UTF-8: never read past them
                    yield column

        yield from _texts(columns(), problem, piece.first_row, text_key)
