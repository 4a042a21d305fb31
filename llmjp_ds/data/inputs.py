"""What ``--input`` names: files, directories and globs, mixed, resolved to an ordered list of :class:`Source` s.

* a file is read by its content: parquet (``PAR1``), Arrow IPC (stream or file format), else jsonl (plain or
  compressed, see ``jsonl.py``);
* a directory is walked in sorted order of its files' relative paths (hidden files and directories skipped),
  taking ``*.parquet``, ``*.arrow`` and jsonl names (``.jsonl``, ``.json``, ``.ndjson``, each plain or
  ``.gz`` / ``.zst`` / ``.bz2`` / ``.xz``); an Arrow dataset directory written by ``datasets.save_to_disk``
  (``state.json`` + ``dataset_info.json`` + ``data-0000i-of-0000n.arrow``) gives its shards in the order its
  ``state.json`` lists them, which is the dataset's row order;
* a glob (``*``, ``?``, ``[``; ``**`` recurses) is expanded in sorted order.

The resolved list is what gets recorded in the corpus summary, so a blend can be audited later. ``datasets``
itself is never imported: its shards are Arrow IPC streams, which pyarrow reads.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from llmjp_ds.data.columnar import (ARROW_FILE_MAGIC, ARROW_STREAM_CONTINUATION, PARQUET_MAGIC, plan_arrow,
                                    plan_parquet, read_rows)
from llmjp_ds.data.jsonl import BadLine, iter_lines, stream_error, text_of_line
from llmjp_ds.errors import fail

SUPPORTED = "jsonl (plain, .gz, .zst, .bz2, .xz), parquet, Arrow (.arrow shards or a datasets.save_to_disk directory)"
JSONL_NAMES = tuple(f"{base}{codec}" for base in (".jsonl", ".json", ".ndjson")
                    for codec in ("", ".gz", ".zst", ".zstd", ".bz2", ".xz"))
STATE_JSON = "state.json"  # datasets' config.DATASET_STATE_JSON_FILENAME
DATASET_DICT_JSON = "dataset_dict.json"


@dataclass(frozen=True)
class Source:
    path: Path
    format: str  # "jsonl" | "parquet" | "arrow"

    def describe(self) -> dict:
        return {"path": str(self.path), "format": self.format, "bytes": self.path.stat().st_size}


def _head(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(8)
    except OSError as exc:
        fail(f"cannot read input {path} ({exc.strerror}): check its permissions and the disk, or copy it "
             f"somewhere readable")


def format_of(path: Path) -> str:
    """``parquet``, ``arrow`` or ``jsonl`` by the file's first bytes; a file named for one and holding another
    (a cut or mis-named download) is refused."""
    head = _head(path)
    if head.startswith(PARQUET_MAGIC):
        return "parquet"
    if head.startswith(ARROW_FILE_MAGIC) or head.startswith(ARROW_STREAM_CONTINUATION):
        return "arrow"
    for named, magic in ((".parquet", "PAR1"), (".arrow", "an Arrow IPC header")):
        if path.name.lower().endswith(named):
            fail(f"{path} is named {named} but does not start with {magic} (it starts {head!r}): the file is "
                 f"truncated, corrupt or mis-named; re-fetch it, or rename it to what it holds")
    return "jsonl"


def _readable_name(name: str) -> bool:
    lower = name.lower()
    return lower.endswith((".parquet", ".arrow") + JSONL_NAMES)


def _dataset_shards(directory: Path) -> list[Path]:
    """The shards of a ``datasets.save_to_disk`` directory, in its ``state.json`` order."""
    state_file = directory / STATE_JSON
    try:
        files = [item["filename"] for item in json.loads(state_file.read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        fail(f"{state_file} is not a datasets state file ({type(exc).__name__}: {exc}): the dataset directory is "
             f"damaged; save it again, or pass its .arrow files themselves")
    shards = [directory / name for name in files]
    for shard in shards:
        if not shard.is_file():
            fail(f"{state_file} lists {shard.name}, which is missing: the dataset is incomplete; copy it again")
    return shards


def _walk(directory: Path) -> list[Path]:
    """The readable files under ``directory``, sorted by relative path; Arrow datasets in their own order."""
    if (directory / DATASET_DICT_JSON).is_file():
        splits = sorted(p.name for p in directory.iterdir() if (p / STATE_JSON).is_file())
        fail(f"{directory} is a datasets DatasetDict (splits: {', '.join(splits) or 'none'}): pass one split's "
             f"directory, e.g. {directory / (splits[0] if splits else 'train')}")
    if (directory / STATE_JSON).is_file():
        return _dataset_shards(directory)
    found: list[tuple[str, list[Path]]] = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        here = Path(root)
        for d in list(dirs):
            if (here / d / STATE_JSON).is_file() or (here / d / DATASET_DICT_JSON).is_file():
                dirs.remove(d)
                found.append(((here / d).relative_to(directory).as_posix(), _walk(here / d)))
        found += [((here / f).relative_to(directory).as_posix(), [here / f]) for f in files
                  if not f.startswith(".") and _readable_name(f)]
    paths = [p for _, group in sorted(found, key=lambda item: item[0]) for p in group]
    if not paths:
        fail(f"directory {directory} holds no input files ({SUPPORTED}): pass the directory of the shards, or "
             f"the files themselves")
    return paths


def _expand(arg: str | Path) -> list[Path]:
    path = Path(arg)
    if path.is_dir():
        return _walk(path)
    if path.exists():
        return [path]
    if any(c in str(arg) for c in "*?["):
        matches = sorted(glob.glob(str(arg), recursive=True))
        if not matches:
            fail(f"--input {str(arg)!r} matches no file: check the pattern")
        return [p for m in matches for p in _expand(m)]
    fail(f"input {path} not found: check the path ({SUPPORTED})")


def resolve_inputs(inputs) -> list[Source]:
    """The ordered sources of ``--input`` (files, directories, globs); each one once, each one readable."""
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    if not inputs:
        fail(f"no input files given: pass one or more files, directories or globs with --input ({SUPPORTED})")
    sources, seen = [], {}
    for arg in inputs:
        for path in _expand(arg):
            key = os.path.realpath(path)
            if key in seen:
                fail(f"input {path} is given twice (by --input {str(seen[key])!r} and {str(arg)!r}): list each file "
                     f"once, so no document is counted twice")
            seen[key] = arg
            sources.append(Source(path, format_of(path)))
    return sources


def iter_documents(inputs, text_key: str = "text", skip_bad: bool = False) -> Iterator[tuple[Path, int, str]]:
    """(file, line or row number, text) for every document of every input, in order, in this process.

    A bad line or row raises a one-line UserError unless ``skip_bad``; a truncated or corrupt file always does."""
    for source in resolve_inputs(inputs):
        path = source.path
        if source.format == "jsonl":
            for lineno, line, _ in iter_lines(path):
                try:
                    text = text_of_line(line, text_key)
                except BadLine as bad:
                    if skip_bad:
                        continue
                    fail(stream_error(path) or f"{path}:{lineno}: {bad}, or pass --skip-bad to skip such lines")
                if text is not None:
                    yield path, lineno, text
            continue
        plan = plan_parquet if source.format == "parquet" else plan_arrow
        slices, problem = plan(path, 1 << 24, text_key)
        if problem is not None and skip_bad:
            continue
        cache: dict = {}
        for piece in slices:
            for row, text in read_rows(piece, text_key, cache):
                if isinstance(text, BadLine):
                    if skip_bad:
                        continue
                    fail(f"{path}: row {row}: {text}, or pass --skip-bad to skip such rows")
                yield path, row, text
