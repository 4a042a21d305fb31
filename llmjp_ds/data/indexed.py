"""Megatron-LM's MMIDIDX indexed dataset: a flat ``.bin`` of tokens and an ``.idx`` that says where each sequence is.

The ``.idx`` layout (little endian), exactly as ``megatron.core.datasets.indexed_dataset`` writes it::

    b"MMIDIDX\\x00\\x00"          9 bytes  magic
    version                     u64      always 1
    dtype code                  u8       1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    sequence count S            u64
    document count D            u64      number of entries in document_indices (= documents + 1)
    sequence_lengths            S x i32  tokens per sequence
    sequence_pointers           S x i64  byte offset of each sequence in the .bin
    document_indices            D x i64  0, then the index one past each document's last sequence
    (sequence_modes             S x i8   only in "multimodal" files; ignored here)

The ``.bin`` is the tokens of every sequence back to back, in the dtype above. ``llmjp-ds preprocess`` writes one
sequence per document (``document_indices == 0..S``), as Megatron-LM does without ``--split-sentences``.
"""

from __future__ import annotations

import contextlib
import os
import struct
from array import array
from pathlib import Path

import numpy as np

from llmjp_ds.io_utils import ensure_writable_dir, fsync_dir, remove_quietly, temp_path_beside
from llmjp_ds.errors import fail

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_BYTES = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count

DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
CODE_OF_DTYPE = {dtype: code for code, dtype in DTYPE_CODES.items()}

REPREPROCESS = "re-run `llmjp-ds preprocess` to rebuild it"


def best_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (Megatron's rule: vocab < 65500), else int32."""
    return np.dtype(np.uint16) if vocab_size is not None and vocab_size < 65500 else np.dtype(np.int32)


def split_prefix(path: str | Path) -> str:
    """``x.bin`` / ``x.idx`` / ``x`` -> ``x`` (users often pass a file instead of the prefix)."""
    text = os.fspath(path)
    for suffix in (".bin", ".idx"):
        if text.endswith(suffix):
            return text[: -len(suffix)]
    return text


def sequence_lengths(prefix: str) -> np.ndarray:
    """The sequence lengths of a corpus's ``.idx``, memory-mapped, without :class:`IndexedDataset`'s pass over
    the whole index (for a corpus already opened once)."""
    _, count, _ = read_index_header(split_prefix(prefix) + ".idx")
    if not count:
        return np.zeros(0, dtype=np.int32)
    return np.memmap(split_prefix(prefix) + ".idx", mode="r", dtype=np.int32, offset=HEADER_BYTES, shape=(count,))


def read_index_header(idx_path: str | Path) -> tuple[np.dtype, int, int]:
    """(dtype, sequence count, document-index count) of an ``.idx``, validated; one-line UserError otherwise."""
    idx_path = Path(idx_path)
    try:
        with open(idx_path, "rb") as f:
            head = f.read(HEADER_BYTES)
    except FileNotFoundError:
        fail(f"corpus index {idx_path} not found: pass the prefix of a .bin/.idx pair written by `llmjp-ds preprocess`")
    except OSError as exc:
        fail(f"cannot read corpus index {idx_path}: {exc.strerror}")
    if len(head) < 9 or head[:9] != INDEX_MAGIC:
        fail(f"{idx_path} is not a Megatron MMIDIDX index (it starts {head[:9]!r}): pass a .idx written by "
             f"`llmjp-ds preprocess` or Megatron-LM's preprocess_data.py")
    if len(head) < HEADER_BYTES:
        fail(f"corpus index {idx_path} is {len(head)} bytes, shorter than its {HEADER_BYTES}-byte header: "
             f"the file is truncated; {REPREPROCESS}")
    version, code, seq_count, doc_count = struct.unpack("<QBQQ", head[9:])
    if version != INDEX_VERSION:
        fail(f"corpus index {idx_path} has format version {version}; only version 1 (Megatron MMIDIDX) is "
             f"supported: {REPREPROCESS}")
    if code not in DTYPE_CODES:
        fail(f"corpus index {idx_path} has unknown dtype code {code} (known: 1-8, uint16=8, int32=4): the file "
             f"is corrupt or from another format; {REPREPROCESS}")
    return DTYPE_CODES[code], seq_count, doc_count


class IndexedDataset:
    """Memory-mapped reader of a Megatron ``.bin``/``.idx`` pair.

    ``len(ds)`` is the number of sequences, ``ds[i]`` the tokens of sequence ``i`` (a read-only numpy view in the
    stored dtype). ``document_indices`` is Megatron's array (``0`` then one past each document's last sequence).
    Every structural check happens here, once, so a corrupt corpus fails at start-up and not at step 90,000.
    """

    def __init__(self, prefix: str | Path):
        self.prefix = split_prefix(prefix)
        self.idx_path = Path(self.prefix + ".idx")
        self.bin_path = Path(self.prefix + ".bin")
        if not self.idx_path.exists() and not self.bin_path.exists():
            fail(f"corpus {self.prefix}: neither {self.idx_path.name} nor {self.bin_path.name} exists: pass the "
                 f"prefix of a pair written by `llmjp-ds preprocess` (e.g. out/ja_wiki_text_document)")
        if not self.bin_path.exists():
            fail(f"corpus {self.prefix}: {self.bin_path} is missing (the .idx exists): copy it beside the .idx "
                 f"or {REPREPROCESS}")
        self.dtype, seq_count, doc_count = read_index_header(self.idx_path)
        idx_size = self.idx_path.stat().st_size
        need = HEADER_BYTES + seq_count * (4 + 8) + doc_count * 8
        if idx_size < need:
            fail(f"corpus index {self.idx_path} is {idx_size} bytes but its header needs {need}: the file is "
                 f"truncated; {REPREPROCESS}")
        if idx_size not in (need, need + seq_count):  # + seq_count: Megatron's optional int8 sequence modes
            fail(f"corpus index {self.idx_path} is {idx_size} bytes but its header describes {need}: the file is "
                 f"corrupt; {REPREPROCESS}")
        self._idx_map = np.memmap(self.idx_path, mode="r", dtype=np.uint8) if idx_size else None
        buf = self._idx_map
        off = HEADER_BYTES
        self.sequence_lengths = np.frombuffer(buf, np.int32, seq_count, off)
        self.sequence_pointers = np.frombuffer(buf, np.int64, seq_count, off + 4 * seq_count)
        self.document_indices = np.frombuffer(buf, np.int64, doc_count, off + 12 * seq_count)
        self._validate()

        bin_size = self.bin_path.stat().st_size
        want = self.num_tokens * self.dtype.itemsize
        if bin_size < want:
            fail(f"corpus {self.bin_path} is {bin_size} bytes but its .idx needs {want}: the file is truncated; "
                 f"{REPREPROCESS}")
        if bin_size > want:
            fail(f"corpus {self.bin_path} is {bin_size} bytes but its .idx describes only {want}: the .bin and "
                 f".idx come from different runs; {REPREPROCESS}")
        # np.memmap refuses empty files; an empty corpus is legal here (callers decide whether it is useful)
        self.tokens = (np.memmap(self.bin_path, mode="r", dtype=self.dtype) if want
                       else np.empty(0, dtype=self.dtype))
        self.sequence_starts = self.sequence_pointers // self.dtype.itemsize

    def _validate(self) -> None:
        lengths, pointers, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        where = f"corpus index {self.idx_path}"
        if len(lengths) and int(lengths.min()) < 0:
            fail(f"{where} has a negative sequence length: the file is corrupt; {REPREPROCESS}")
        expected = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1], dtype=np.int64, out=expected[1:])
        self.num_tokens = int(expected[-1] + lengths[-1]) if len(lengths) else 0
        if not np.array_equal(pointers, expected * self.dtype.itemsize):
            fail(f"{where} has sequence pointers that are not the running sum of its lengths: the file is "
                 f"corrupt; {REPREPROCESS}")
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != len(lengths) or np.any(np.diff(docs) < 0):
            fail(f"{where} has document indices that do not run from 0 to its {len(lengths)} sequences: the "
                 f"file is corrupt; {REPREPROCESS}")

    def __reduce__(self):  # pickles as its prefix: a worker process maps the files itself, nothing is copied
        return (IndexedDataset, (self.prefix,))

    # -- sequences -------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self.sequence_lengths)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {n} sequences in {self.prefix}")
        start = int(self.sequence_starts[i])
        return self.tokens[start:start + int(self.sequence_lengths[i])]

    # -- documents -------------------------------------------------------------------------------------
    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def document_token_spans(self) -> tuple[np.ndarray, np.ndarray]:
        """(first token, token count) of every document, as int64 arrays; documents are contiguous in the .bin."""
        cum = np.zeros(len(self.sequence_lengths) + 1, dtype=np.int64)
        np.cumsum(self.sequence_lengths, dtype=np.int64, out=cum[1:])
        starts = cum[self.document_indices[:-1]]
        return starts, cum[self.document_indices[1:]] - starts

    def document(self, d: int) -> np.ndarray:
        first, last = int(self.document_indices[d]), int(self.document_indices[d + 1])
        if first == last:
            return self.tokens[0:0]
        start = int(self.sequence_starts[first])
        return self.tokens[start:start + int(self.sequence_lengths[first:last].sum())]

    def max_token_id(self, chunk_tokens: int = 1 << 26) -> int:
        """Largest token id in the corpus (-1 if empty); reads the whole .bin in chunks."""
        best = -1
        for start in range(0, self.num_tokens, chunk_tokens):
            best = max(best, int(self.tokens[start:start + chunk_tokens].max()))
        return best

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.prefix!r}: {self.num_documents} documents, {len(self)} sequences, "
                f"{self.num_tokens} tokens, {self.dtype.name})")


def check_output_free(prefix: str, force: bool) -> None:
    """Refuse to overwrite an existing corpus unless ``force``."""
    existing = [p for p in (prefix + ".bin", prefix + ".idx") if os.path.exists(p)]
    if existing and not force:
        fail(f"output {existing[0]} already exists: choose another --output-prefix, or pass --force to replace it")


class IndexedDatasetWriter:
    """Write a ``.bin``/``.idx`` pair atomically: use as a context manager, ``add_document`` per document.

    Tokens go to a hidden temp file beside the final name; on a clean exit both files are fsync'd and renamed
    into place, the ``.idx`` last, so a pair under the final names is always complete. On an exception (or
    Ctrl-C) the temp files are removed and nothing under the final names changes.
    """

    def __init__(self, prefix: str | Path, dtype, force: bool = False):
        self.prefix = split_prefix(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"dtype {self.dtype} cannot be stored in an MMIDIDX file")
        self.force = force
        self._lengths = array("i")  # int32, as stored
        self._documents = array("q", [0])
        self._bin = None
        self._bin_tmp: Path | None = None
        self.num_tokens = 0
        self._sidecars: dict[str, bytes] = {}
        if np.issubdtype(self.dtype, np.integer):
            info = np.iinfo(self.dtype)
            self._lo, self._hi = int(info.min), int(info.max)
        else:
            self._lo = self._hi = None

    def __enter__(self) -> "IndexedDatasetWriter":
        check_output_free(self.prefix, self.force)
        ensure_writable_dir(Path(self.prefix).parent)
        self._bin_tmp = temp_path_beside(self.prefix + ".bin")
        self._bin = open(self._bin_tmp, "wb", buffering=1 << 20)
        return self

    def add_document(self, tokens) -> None:
        """Append one document as one sequence."""
        self.add_documents(np.asarray(tokens).reshape(-1), [np.asarray(tokens).size])

    def add_documents(self, flat_tokens, lengths) -> None:
        """Append many documents at once: ``flat_tokens`` is their concatenation, ``lengths`` their sizes."""
        if self._bin is None:
            raise RuntimeError("IndexedDatasetWriter must be used as a context manager")
        flat = np.asarray(flat_tokens).reshape(-1)
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if int(lengths.sum()) != flat.size:
            raise ValueError(f"lengths sum to {int(lengths.sum())} but {flat.size} tokens were given")
        if len(lengths) and (lengths.min() < 0 or lengths.max() > np.iinfo(np.int32).max):
            fail(f"a document of {int(lengths.max())} tokens does not fit Megatron's int32 sequence length: "
                 f"split the document")
        if flat.size and self._lo is not None and flat.dtype != self.dtype:
            lo, hi = int(flat.min()), int(flat.max())
            if lo < self._lo or hi > self._hi:
                bad = lo if lo < self._lo else hi
                fail(f"token id {bad} does not fit the corpus dtype {self.dtype.name}: use a tokenizer whose ids "
                     f"fit, or write with int32")
        self._bin.write(flat.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.extend(lengths.astype(np.int32).tolist())
        last = self._documents[-1]  # one sequence per document: document i ends after sequence i
        self._documents.extend(range(last + 1, last + 1 + len(lengths)))
        self.num_tokens += flat.size

    def attach(self, suffix: str, data: bytes) -> None:
        """Write ``data`` as ``PREFIX + suffix`` in the same commit as the corpus: put in place after the ``.bin``
        and before the ``.idx``, so an ``.idx`` under its final name always has it beside (an old one is removed
        with the old ``.idx``)."""
        self._sidecars[suffix] = data

    @property
    def num_documents(self) -> int:
        return len(self._documents) - 1

    def _index_bytes(self) -> bytes:
        lengths = np.frombuffer(self._lengths, dtype=np.int32) if len(self._lengths) else np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        docs = np.frombuffer(self._documents, dtype=np.int64)
        head = INDEX_MAGIC + struct.pack("<QBQQ", INDEX_VERSION, CODE_OF_DTYPE[self.dtype], len(lengths), len(docs))
        return head + lengths.tobytes() + pointers.tobytes() + docs.tobytes()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
            return
        idx_tmp = None
        tmps: dict[str, Path] = {}
        try:
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
            idx_tmp = temp_path_beside(self.prefix + ".idx")
            with open(idx_tmp, "wb") as f:
                f.write(self._index_bytes())
                f.flush()
                os.fsync(f.fileno())
            for suffix, data in self._sidecars.items():
                tmps[suffix] = temp_path_beside(self.prefix + suffix)
                with open(tmps[suffix], "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            check_output_free(self.prefix, self.force)  # someone may have written it while we worked
            # an old .idx must never sit beside the new .bin: drop it first, put the new .idx in place last
            remove_quietly(self.prefix + ".idx")
            for suffix in tmps:
                remove_quietly(self.prefix + suffix)
            os.replace(self._bin_tmp, self.prefix + ".bin")
            for suffix, tmp in tmps.items():
                os.replace(tmp, self.prefix + suffix)
            os.replace(idx_tmp, self.prefix + ".idx")
            fsync_dir(Path(self.prefix).parent)
        except BaseException:
            for tmp in [idx_tmp, *tmps.values()]:
                if tmp is not None:
                    remove_quietly(tmp)
            self.abort()
            raise

    def abort(self) -> None:
        """Close and remove the temp file. Never raises an OSError of its own: after a failed write (a full disk,
        a file-size limit) ``close()`` fails again flushing the same buffer, and that must not keep the temp
        file or hide the first error."""
        try:
            if self._bin is not None and not self._bin.closed:
                try:
                    self._bin.close()
                except OSError:
                    with contextlib.suppress(OSError):
                        self._bin.raw.close()  # the buffer is lost with the file; release the descriptor
        finally:
            if self._bin_tmp is not None:
                with contextlib.suppress(OSError):
                    remove_quietly(self._bin_tmp)
