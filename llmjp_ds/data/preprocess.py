"""``llmjp-ds preprocess``: jsonl (plain, .gz, .zst, .bz2, .xz) -> ``PREFIX_text_document.bin/.idx`` (Megatron MMIDIDX).

Each document becomes one sequence ``[bos] + sp.encode(text) + [eos]``, framed by ``Tokenizer.encode_documents``:
byte for byte what Megatron-LM's ``tools/preprocess_data.py --tokenizer-type Llama2Tokenizer --append-eod`` writes
for the same model (its ``eod`` is the model's ``eos_id``; an empty text still gives ``[bos, eos]``), so LLM-jp's
corpora and ours mix.

The main process reads raw lines and writes; worker processes parse json and tokenize chunks of ~1 MB. Results
come back in input order, so any ``workers`` gives the same bytes. At most ``2 * workers + 2`` chunks are in flight,
so memory stays flat however large the input. Output is written atomically (see ``IndexedDatasetWriter``): a
failure at any point (a bad line, a truncated input, a full disk) leaves no temp file, no partial corpus and no
directory that the run created.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import shutil
import sys
import time
from pathlib import Path
from typing import NoReturn

from llmjp_ds.data.indexed import IndexedDatasetWriter, best_dtype, check_output_free
from llmjp_ds.data.pool import ordered_map
from llmjp_ds.data.jsonl import BadLine, check_inputs, iter_lines, stream_error, text_of_line
from llmjp_ds.errors import fail

OUTPUT_SUFFIX = "_text_document"
CHUNK_BYTES = 1 << 20


def output_prefix_for(output_prefix: str | Path) -> str:
    """The corpus prefix ``preprocess`` writes for ``--output-prefix`` (Megatron's ``{prefix}_text_document``)."""
    return os.fspath(output_prefix) + OUTPUT_SUFFIX


class ChunkEncoder:
    """What a tokenizing worker runs on one chunk of lines: ``(path, first line number, lines)`` -> (tokens,
    lengths, skipped {kind: n}, first skipped message, error), where error is None or (file, message).

    Picklable and small (the tokenizer's path and the options); the tokenizer is loaded on first use and kept on
    the object, so each worker process loads it once."""

    def __init__(self, model_path: str, text_key: str, skip_bad: bool):
        self.model_path, self.text_key, self.skip_bad = model_path, text_key, skip_bad
        self._tok = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tok": None}

    @property
    def tok(self):
        if self._tok is None:
            from llmjp_ds.data.tokenizer import load_tokenizer

            self._tok = load_tokenizer(self.model_path)
        return self._tok

    def __call__(self, chunk: tuple[str, int, list[bytes]]):
        path, first_lineno, lines = chunk
        tok, key, skip_bad = self.tok, self.text_key, self.skip_bad
        texts: list[str] = []
        linenos: list[int] = []
        skipped: dict[str, int] = {}
        first_skip = None

        def bad_line(lineno: int, bad: BadLine):
            nonlocal first_skip
            where = f"{path}:{lineno}"
            if not skip_bad:
                return path, f"{where}: {bad}, or pass --skip-bad to skip such lines"
            skipped[bad.kind] = skipped.get(bad.kind, 0) + 1
            first_skip = first_skip or f"{where}: {bad}"
            return None

        for n, line in enumerate(lines):
            try:
                text = text_of_line(line, key)
            except BadLine as bad:
                error = bad_line(first_lineno + n, bad)
                if error:
                    return None, None, skipped, None, error
                continue
            if text is not None:
                texts.append(text)
                linenos.append(first_lineno + n)
        try:
            flat, lengths = tok.encode_documents(texts)
        except Exception:  # a text the tokenizer rejects: find it, and treat it as a bad line
            kept = []
            for lineno, text in zip(linenos, texts):
                try:
                    tok.encode_documents([text])
                except Exception as exc:
                    error = bad_line(lineno, BadLine("unencodable text", f"the tokenizer cannot encode {key!r} "
                                                                         f"({type(exc).__name__}: {exc}); fix or "
                                                                         f"remove the line"))
                    if error:
                        return None, None, skipped, None, error
                    continue
                kept.append(text)
            flat, lengths = tok.encode_documents(kept)
        return flat, lengths, skipped, first_skip, None


def _chunks(paths: list[Path], chunk_bytes: int, progress):
    """(path, first line number, lines) of about ``chunk_bytes`` each, never spanning two files."""
    for path in paths:
        lines: list[bytes] = []
        size = 0
        first = 1
        last_raw = 0
        for lineno, line, raw_pos in iter_lines(path):
            if not lines:
                first = lineno
            lines.append(line)
            size += len(line)
            if size >= chunk_bytes:
                yield str(path), first, lines
                progress.update(raw_pos - last_raw)
                last_raw = raw_pos
                lines, size = [], 0
        if lines:
            yield str(path), first, lines
        progress.update(path.stat().st_size - last_raw)


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


def _free_space(path: Path) -> str:
    for d in [path, *path.parents]:
        try:
            free = shutil.disk_usage(d).free
        except OSError:
            continue
        for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if free >= size:
                return f"{free / size:.1f} {unit} free"
        return f"{free} bytes free"
    return "free space unknown"


def _write_failed(prefix: str, exc: OSError) -> NoReturn:
    """One line for an OSError while writing the corpus (full disk, file-size limit, quota, I/O error)."""
    name = errno.errorcode.get(exc.errno, "") if exc.errno else ""
    why = f"{exc.strerror or exc}{f' ({name})' if name else ''}"
    fail(f"cannot write {prefix}.bin/.idx: {why}; {_free_space(Path(prefix).parent)} there: free space (or raise "
         f"the file-size limit or quota) or choose another --output-prefix, then run again; nothing was written")


class _NoProgress:
    def update(self, n):
        pass

    def close(self):
        pass


@contextlib.contextmanager
def _output_errors(prefix: str):
    try:
        yield
    except OSError as exc:
        _write_failed(prefix, exc)


def preprocess(inputs: list[str | Path], tokenizer: str | Path, output_prefix: str | Path, workers: int = 1,
               text_key: str = "text", force: bool = False, skip_bad: bool = False, progress: bool | None = None,
               chunk_bytes: int = CHUNK_BYTES) -> dict:
    """Tokenize jsonl files into ``{output_prefix}_text_document.bin/.idx``; returns statistics.

    ``progress``: None shows a bar when stderr is a terminal. Bad lines raise a one-line UserError naming
    ``file:line``, unless ``skip_bad``, which counts them instead (``stats["skipped"]``).
    """
    from llmjp_ds.data.tokenizer import load_tokenizer

    start = time.perf_counter()
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        fail(f"--workers {workers}: need at least 1 (worker processes that tokenize)")
    paths = check_inputs(inputs)
    tok = load_tokenizer(tokenizer)
    prefix = output_prefix_for(output_prefix)
    check_output_free(prefix, force)  # before hours of work, not after
    _check_output_dir(prefix)
    created = _missing_dirs(Path(prefix).parent)
    dtype = best_dtype(tok.vocab_size)

    bar = _NoProgress()
    if progress is not False:
        from tqdm import tqdm

        bar = tqdm(total=sum(p.stat().st_size for p in paths), unit="B", unit_scale=True, file=sys.stderr,
                   desc="preprocess", disable=None if progress is None else False, dynamic_ncols=True)
    skipped: dict[str, int] = {}
    first_skip = None
    encoder = ChunkEncoder(str(tok.model_path), text_key, skip_bad)
    ok = False
    try:
        results = ordered_map(encoder, _chunks(paths, chunk_bytes, bar), workers)
        # the inputs' read errors are UserErrors by now (jsonl.iter_lines): an OSError here is the output's
        with _output_errors(prefix), contextlib.closing(results), \
                IndexedDatasetWriter(prefix, dtype, force=force) as writer:
            for flat, lengths, chunk_skipped, chunk_first, error in results:
                if error:
                    # garbage from a corrupt compressed stream looks like a bad line: blame the stream if it is bad
                    fail(stream_error(Path(error[0])) or error[1])
                for kind, n in chunk_skipped.items():
                    skipped[kind] = skipped.get(kind, 0) + n
                first_skip = first_skip or chunk_first
                if flat.size and (int(flat.max()) >= tok.vocab_size or int(flat.min()) < 0):
                    bad = int(flat.max()) if int(flat.max()) >= tok.vocab_size else int(flat.min())
                    fail(f"token id {bad} is outside the vocabulary (size {tok.vocab_size}) of {tok.model_path}: "
                         f"the tokenizer file is corrupt; re-train or re-download it")
                writer.add_documents(flat, lengths)
            if writer.num_documents == 0:
                why = f" ({sum(skipped.values())} bad lines skipped, e.g. {first_skip})" if skipped else ""
                fail(f"no documents in {', '.join(map(str, paths))}{why}: nothing to write; check the files and "
                     f"--text-key {text_key!r}")
            documents, tokens = writer.num_documents, writer.num_tokens
        ok = True
    finally:
        bar.close()
        if not ok:
            for d in created:  # deepest first; only what this run made, and only if still empty
                with contextlib.suppress(OSError):
                    d.rmdir()
    seconds = time.perf_counter() - start
    return {
        "prefix": prefix, "documents": documents, "tokens": tokens, "skipped": sum(skipped.values()),
        "skipped_by_kind": skipped, "first_skipped": first_skip, "seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds > 0 else float("inf"), "dtype": dtype.name,
        "vocab_size": tok.vocab_size, "workers": workers,
    }


def cli_main(argv: list[str], verb: str = "preprocess") -> int:
    parser = argparse.ArgumentParser(
        prog=f"llmjp-ds {verb}",
        description="Tokenize jsonl into a Megatron-LM indexed corpus PREFIX_text_document.bin/.idx "
                    "([bos] + pieces + [eos] per document, as Megatron's --append-eod).")
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE",
                        help="jsonl, .jsonl.gz, .jsonl.zst, .jsonl.bz2 or .jsonl.xz")
    parser.add_argument("--tokenizer", required=True,
                        help="SentencePiece .model, or a directory holding tokenizer.model")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX_text_document.bin and .idx")
    parser.add_argument("--workers", type=int, default=max(1, min(8, os.cpu_count() or 1)))
    parser.add_argument("--text-key", default="text", help="json key holding the document text (default: text)")
    parser.add_argument("--force", action="store_true", help="replace an existing output")
    parser.add_argument("--skip-bad", action="store_true",
                        help="skip lines that are not json objects with a string text key, and count them")
    args = parser.parse_args(argv)
    stats = preprocess(args.input, args.tokenizer, args.output_prefix, workers=args.workers, text_key=args.text_key,
                       force=args.force, skip_bad=args.skip_bad)
    print(f"wrote {stats['prefix']}.bin/.idx: {stats['documents']:,} documents, {stats['tokens']:,} tokens "
          f"({stats['dtype']}) in {stats['seconds']:.1f} s, {stats['tokens_per_second']:,.0f} tokens/s with "
          f"{stats['workers']} workers", file=sys.stderr)
    if stats["skipped"]:
        kinds = ", ".join(f"{n} {kind}" for kind, n in stats["skipped_by_kind"].items())
        print(f"skipped {stats['skipped']:,} bad lines ({kinds}); first: {stats['first_skipped']}", file=sys.stderr)
    return 0
