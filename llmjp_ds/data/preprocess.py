"""``llmjp-ds preprocess``: jsonl, parquet and Arrow inputs -> ``PREFIX_text_document.bin/.idx`` (Megatron MMIDIDX).

Each document becomes one sequence ``[bos] + sp.encode(text) + [eos]``, framed by ``Tokenizer.encode_documents``:
byte for byte what Megatron-LM's ``tools/preprocess_data.py --tokenizer-type Llama2Tokenizer --append-eod`` writes
for the same model (its ``eod`` is the model's ``eos_id``; an empty text still gives ``[bos, eos]``), so LLM-jp's
corpora and ours mix.

Inputs are files, directories and globs (``inputs.py``). The main process reads jsonl lines and writes; worker
processes parse json, read their own slices of parquet and Arrow files (``columnar.py``), and tokenize
(``chunks.py``). Results come back in input order (``pool.py``), so any ``workers`` gives the same bytes, and the
same documents give the same bytes whatever file format holds them. At most ``2 * workers + 2`` chunks (~1 MB of
jsonl, or a parquet row group) are in flight, so memory stays flat however large the input. Beside the corpus,
``PREFIX_text_document.json`` records the inputs in order, per input its documents, tokens and skipped rows, and
the tokenizer's sha256, so a blend can be audited later. Output is written atomically (see ``IndexedDatasetWriter``): a
failure at any point (a bad line, a truncated input, a full disk) leaves no temp file, no partial corpus and no
directory that the run created.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import NoReturn

from llmjp_ds.data.chunks import ChunkEncoder, Encoded, plan_columnar, tasks
from llmjp_ds.data.indexed import IndexedDatasetWriter, best_dtype, check_output_free
from llmjp_ds.data.inputs import SUPPORTED, Source, resolve_inputs
from llmjp_ds.data.jsonl import stream_error
from llmjp_ds.data.pool import ordered_map
from llmjp_ds.data.tokenizer import load_tokenizer
from llmjp_ds.errors import fail
from llmjp_ds.io_utils import free_space

OUTPUT_SUFFIX = "_text_document"
CHUNK_BYTES = 1 << 20


def output_prefix_for(output_prefix: str | Path) -> str:
    """The corpus prefix ``preprocess`` writes for ``--output-prefix`` (Megatron's ``{prefix}_text_document``)."""
    return os.fspath(output_prefix) + OUTPUT_SUFFIX


def _missing_dirs(directory: Path) -> list[Path]:
    """``directory`` and its ancestors that do not exist yet, deepest first (what writing would create)."""
    missing = []
    for d in [directory, *directory.parents]:
        if d.exists():
            break
        missing.append(d)
    return missing


def _check_output_dir(prefix: str) -> None:
    parent = Path(prefix).parent
    for d in [parent, *parent.parents]:
        if d.exists():
            if not d.is_dir():
                fail(f"cannot write {prefix}.bin: {d} is a file, not a directory; choose another --output-prefix")
            if not os.access(d, os.W_OK | os.X_OK):
                fail(f"cannot write {prefix}.bin: directory {d} is not writable; choose another --output-prefix "
                     f"or fix its permissions")
            return


def _write_failed(prefix: str, exc: OSError) -> NoReturn:
    """One line for an OSError while writing the corpus (full disk, file-size limit, quota, I/O error)."""
    name = errno.errorcode.get(exc.errno, "") if exc.errno else ""
    why = f"{exc.strerror or exc}{f' ({name})' if name else ''}"
    fail(f"cannot write {prefix}.bin/.idx: {why}; {free_space(Path(prefix).parent)} there: free space (or raise "
         f"the file-size limit or quota) or choose another --output-prefix, then run again; nothing was written")


@contextlib.contextmanager
def _output_errors(prefix: str):
    try:
        yield
    except OSError as exc:
        _write_failed(prefix, exc)


class _Progress:
    """One bar over the whole input (bytes: compressed for jsonl, by rows for columnar files), with documents/s
    and tokens/s; silent when stderr is not a terminal (``progress=None``) or when off."""

    def __init__(self, total: int, progress: bool | None):
        self.bar = None
        self.start, self.shown, self.documents, self.tokens = time.perf_counter(), 0.0, 0, 0
        if progress is not False:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, file=sys.stderr, desc="preprocess",
                            disable=None if progress is None else False, dynamic_ncols=True)

    def update(self, nbytes: int, documents: int, tokens: int) -> None:
        self.documents, self.tokens = self.documents + documents, self.tokens + tokens
        if self.bar is None or self.bar.disable:
            return
        now = time.perf_counter()
        if now - self.shown > 0.5:
            seconds = max(now - self.start, 1e-9)
            self.bar.set_postfix_str(f"{self.documents / seconds:,.0f} docs/s, {self.tokens / seconds:,.0f} "
                                     f"tokens/s", refresh=False)
            self.shown = now
        self.bar.update(nbytes)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _add(total: dict, part: dict) -> None:
    for kind, n in part.items():
        total[kind] = total.get(kind, 0) + n


class _Tally:
    """Documents, tokens and skipped rows per input, the first skipped row, and the vocabulary check."""

    def __init__(self, sources: list[Source], tok):
        self.tok = tok
        self.inputs = [{**s.describe(), "documents": 0, "tokens": 0, "skipped": {}} for s in sources]
        self.first_skip = None

    def take(self, enc: Encoded, sources: list[Source]) -> None:
        if enc.error:
            # garbage from a corrupt compressed stream looks like a bad line: blame the stream if it is bad
            path = Path(enc.error[0])
            jsonl = sources[enc.source].format == "jsonl"
            fail((stream_error(path) if jsonl else None) or enc.error[1])
        entry = self.inputs[enc.source]
        _add(entry["skipped"], enc.skipped)
        self.first_skip = self.first_skip or enc.first_skip
        flat, vocab = enc.flat, self.tok.vocab_size
        if flat.size and (int(flat.max()) >= vocab or int(flat.min()) < 0):
            bad = int(flat.max()) if int(flat.max()) >= vocab else int(flat.min())
            fail(f"token id {bad} is outside the vocabulary (size {vocab}) of {self.tok.model_path}: the "
                 f"tokenizer file is corrupt; re-train or re-download it")
        entry["documents"] += len(enc.lengths)
        entry["tokens"] += int(flat.size)

    def skipped(self) -> dict:
        total: dict = {}
        for entry in self.inputs:
            _add(total, entry["skipped"])
        return total


def _summary(prefix: str, tok, tally: _Tally, text_key: str, dtype) -> dict:
    """What ``PREFIX_text_document.json`` holds: enough to audit a blend (which files, in which order, with
    which tokenizer, gave which documents)."""
    return {
        "corpus": prefix, "documents": sum(e["documents"] for e in tally.inputs),
        "tokens": sum(e["tokens"] for e in tally.inputs), "skipped": tally.skipped(), "dtype": dtype.name,
        "text_key": text_key,
        "tokenizer": {"path": str(tok.model_path), "sha256": file_sha256(tok.model_path),
                      "vocab_size": tok.vocab_size},
        "inputs": tally.inputs,
    }


def preprocess(inputs: list[str | Path], tokenizer: str | Path, output_prefix: str | Path, workers: int = 1,
               text_key: str = "text", force: bool = False, skip_bad: bool = False, progress: bool | None = None,
               chunk_bytes: int = CHUNK_BYTES) -> dict:
    """Tokenize jsonl, parquet and Arrow inputs (files, directories, globs) into
    ``{output_prefix}_text_document.bin/.idx`` and its ``.json`` summary; returns statistics.

    ``progress``: None shows a bar when stderr is a terminal. Bad lines or rows raise a one-line UserError naming
    the file and line (row), unless ``skip_bad``, which counts them instead (``stats["skipped_by_kind"]``).
    """
    start = time.perf_counter()
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        fail(f"--workers {workers}: need at least 1 (worker processes that tokenize)")
    sources = resolve_inputs(inputs)
    tok = load_tokenizer(tokenizer)
    prefix = output_prefix_for(output_prefix)
    check_output_free(prefix, force)  # before hours of work, not after
    _check_output_dir(prefix)
    plans = plan_columnar(sources, chunk_bytes, text_key, skip_bad)
    created = _missing_dirs(Path(prefix).parent)
    dtype = best_dtype(tok.vocab_size)
    bar = _Progress(sum(s.path.stat().st_size for s in sources), progress)
    tally = _Tally(sources, tok)
    encoder = ChunkEncoder(str(tok.model_path), text_key, skip_bad)
    ok = False
    try:
        results = ordered_map(encoder, tasks(sources, plans, chunk_bytes), workers)
        # the inputs' read errors are UserErrors by now (jsonl.iter_lines): an OSError here is the output's
        with _output_errors(prefix), contextlib.closing(results), \
                IndexedDatasetWriter(prefix, dtype, force=force) as writer:
            for enc in results:
                tally.take(enc, sources)
                writer.add_documents(enc.flat, enc.lengths)
                bar.update(enc.progress, len(enc.lengths), int(enc.flat.size))
            if writer.num_documents == 0:
                skipped = tally.skipped()
                unit = "lines" if all(s.format == "jsonl" for s in sources) else "lines or rows"
                why = f" ({sum(skipped.values())} bad {unit} skipped, e.g. {tally.first_skip})" if skipped else ""
                fail(f"no documents in {', '.join(str(s.path) for s in sources)}{why}: nothing to write; check the "
                     f"files and --text-key {text_key!r}")
            summary = _summary(prefix, tok, tally, text_key, dtype)
            writer.attach(".json", (json.dumps(summary, indent=1, ensure_ascii=False) + "\n").encode())
        ok = True
    finally:
        bar.close()
        if not ok:
            for d in created:  # deepest first; only what this run made, and only if still empty
                with contextlib.suppress(OSError):
                    d.rmdir()
    seconds = time.perf_counter() - start
    return {
        **{k: summary[k] for k in ("documents", "tokens", "inputs", "tokenizer")}, "prefix": prefix,
        "skipped": sum(summary["skipped"].values()), "skipped_by_kind": summary["skipped"],
        "first_skipped": tally.first_skip, "seconds": seconds, "dtype": dtype.name, "vocab_size": tok.vocab_size,
        "tokens_per_second": summary["tokens"] / seconds if seconds > 0 else float("inf"), "workers": workers,
    }


def _print_summary(stats: dict) -> None:
    for entry in stats["inputs"]:
        skipped = ", ".join(f"{n:,} {kind}" for kind, n in entry["skipped"].items())
        print(f"  {entry['path']} ({entry['format']}): {entry['documents']:,} documents, {entry['tokens']:,} tokens"
              f"{f'; skipped {skipped}' if skipped else ''}", file=sys.stderr)
    print(f"wrote {stats['prefix']}.bin/.idx/.json: {stats['documents']:,} documents, {stats['tokens']:,} tokens "
          f"({stats['dtype']}) from {len(stats['inputs'])} inputs in {stats['seconds']:.1f} s, "
          f"{stats['tokens_per_second']:,.0f} tokens/s with {stats['workers']} workers", file=sys.stderr)
    if stats["skipped"]:
        kinds = ", ".join(f"{n} {kind}" for kind, n in stats["skipped_by_kind"].items())
        unit = "lines" if all(e["format"] == "jsonl" for e in stats["inputs"]) else "lines or rows"
        print(f"skipped {stats['skipped']:,} bad {unit} ({kinds}); first: {stats['first_skipped']}", file=sys.stderr)


def cli_main(argv: list[str], verb: str = "preprocess") -> int:
    parser = argparse.ArgumentParser(
        prog=f"llmjp-ds {verb}",
        description="Tokenize jsonl, parquet or Arrow datasets into a Megatron-LM indexed corpus "
                    "PREFIX_text_document.bin/.idx ([bos] + pieces + [eos] per document, as Megatron's "
                    "--append-eod), with a PREFIX_text_document.json summary.")
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH",
                        help=f"files, directories or globs (quoted), mixed: {SUPPORTED}")
    parser.add_argument("--tokenizer", required=True,
                        help="SentencePiece .model, or a directory holding tokenizer.model")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX_text_document.bin, .idx and .json")
    parser.add_argument("--workers", type=int, default=max(1, min(8, os.cpu_count() or 1)))
    parser.add_argument("--text-key", default="text",
                        help="json key or column holding the document text (default: text)")
    parser.add_argument("--force", action="store_true", help="replace an existing output")
    parser.add_argument("--skip-bad", action="store_true",
                        help="skip lines or rows without a string text (and unparsable lines), and count them")
    args = parser.parse_args(argv)
    stats = preprocess(args.input, args.tokenizer, args.output_prefix, workers=args.workers, text_key=args.text_key,
                       force=args.force, skip_bad=args.skip_bad)
    _print_summary(stats)
    return 0
