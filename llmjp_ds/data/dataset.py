"""Training samples: GPT windows over shuffled documents, a train/valid split, and a weighted blend of corpora.

One corpus, one split (``CorpusWindows``):
  * documents ``[first, last)`` of the corpus form the split (train first, then valid: Megatron's document split);
  * epoch ``e`` visits those documents in the order ``rng(seed, split, e).permutation``; the epochs are laid end
    to end as one token stream;
  * sample ``j`` is the window ``stream[j * seq_len : j * seq_len + seq_len + 1]``: windows cross document
    boundaries and overlap by one token (inputs = window[:-1], labels = window[1:]), as Megatron's GPTDataset;
  * an epoch holds ``B = (tokens - 1) // seq_len`` windows, and the windows of epoch block ``b`` are permuted by
    ``rng(seed, split, b, 1)``; only whole blocks are built, so ``len >= num_samples``.
  The index is two arrays per sample (which document of the stream it starts in, and where), built with numpy
  (``searchsorted`` over the cumulative lengths; no Python loop over documents), so ``get(j)`` is O(1).

A blend (``SampleDataset``): the ``k``-th sample of corpus ``c`` is due at time ``(k + 0.5) / w_c`` and samples
are taken in order of due time (ties to the earlier corpus). That is the divisor (Sainte-Lague) apportionment:
after any ``n`` samples each corpus has ``n * w_c`` of them to within about one, like Megatron's greedy
error-minimising blend, and it is prefix-stable: raising ``train_samples`` later only appends samples.

Every index is cached as ``.npy`` files under ``cache_dir`` (default: ``<corpus dir>/_llmjp_index/``), in a
directory named by a hash of everything it depends on, written to a temp directory and renamed into place. A
file lock keeps concurrent builders from duplicating work; with ``barrier``, rank 0 builds and the others wait.
Resuming a run is ``dataset[consumed_samples + k]``: nothing about the order depends on how far a run got.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from llmjp_ds.data.indexed import IndexedDataset, split_prefix
from llmjp_ds.errors import fail
from llmjp_ds.io_utils import fsync_dir, remove_quietly

INDEX_FORMAT = 1  # bump when the index layout or the sampling rule changes: old caches are then ignored
CACHE_DIR_NAME = "_llmjp_index"
SPLIT_NAMES = ("train", "valid", "test")
BLEND_CHUNK = 1 << 22


# -- blend specification ------------------------------------------------------------------------------------
def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _check_prefix(prefix: str) -> str:
    prefix = split_prefix(prefix)
    missing = [p for p in (prefix + ".bin", prefix + ".idx") if not os.path.exists(p)]
    if missing:
        hint = " (did you mean the _text_document prefix?)" if os.path.exists(prefix + "_text_document.idx") else ""
        fail(f"corpus {prefix}: {', '.join(missing)} not found{hint}: pass the prefix of a .bin/.idx pair written "
             f"by `llmjp-ds preprocess`")
    return prefix


def _blend_tokens(items: Sequence[str] | str) -> list[str]:
    if isinstance(items, (str, os.PathLike)):
        items = [os.fspath(items)]
    tokens = [os.fspath(t) for t in items]
    if len(tokens) == 1 and len(tokens[0].split()) > 1 and not os.path.exists(split_prefix(tokens[0]) + ".idx"):
        tokens = tokens[0].split()  # "0.3 a 0.7 b" given as one string (a config file value)
    return tokens


def blend_has_weights(items: Sequence[str] | str) -> bool:
    """Whether a blend gives weights (``w1 prefix1 ...``) or prefixes alone, which Megatron treats as "no
    weights" (each corpus taken once) where :func:`parse_blend` weights them by their token counts."""
    return any(_is_number(t) for t in _blend_tokens(items))


def parse_blend(items: Sequence[str] | str) -> list[tuple[float, str]]:
    """Megatron-style ``w1 prefix1 w2 prefix2 ...`` -> ``[(w1, prefix1), ...]``; a lone prefix gets weight 1.

    Prefixes without any weights (``prefix1 prefix2``) are weighted by their token counts, which is what LLM-jp
    did (one pass over every corpus). Weights need not sum to 1. Files are checked here, not at step 1.
    """
    tokens = _blend_tokens(items)
    if not tokens:
        fail("empty data blend: pass `PREFIX` or `WEIGHT PREFIX WEIGHT PREFIX ...`")
    numeric = [_is_number(t) for t in tokens]
    if not any(numeric):
        prefixes = [_check_prefix(t) for t in tokens]
        if len(prefixes) == 1:
            return [(1.0, prefixes[0])]
        return [(float(corpus_tokens(p)), p) for p in prefixes]
    if len(tokens) % 2:
        fail(f"data blend has {len(tokens)} items: give pairs `WEIGHT PREFIX ...` (or a single PREFIX)")
    blend = []
    for weight_text, prefix in zip(tokens[0::2], tokens[1::2]):
        if not _is_number(weight_text):
            fail(f"data blend weight {weight_text!r} (before {prefix}) is not a number: give pairs "
                 f"`WEIGHT PREFIX ...`")
        if _is_number(prefix) and not os.path.exists(prefix + ".idx"):
            fail(f"data blend item {prefix!r} is a number where a corpus prefix should be: give pairs "
                 f"`WEIGHT PREFIX ...`")
        weight = float(weight_text)
        if not math.isfinite(weight) or weight < 0:
            fail(f"data blend weight {weight_text} for {prefix} must be a finite number >= 0")
        blend.append((weight, _check_prefix(prefix)))
    if sum(w for w, _ in blend) <= 0:
        fail("every data blend weight is 0: give at least one corpus a positive weight")
    return blend


def corpus_tokens(prefix: str) -> int:
    """Token count of a corpus (from its .idx)."""
    return IndexedDataset(prefix).num_tokens


# -- caching ------------------------------------------------------------------------------------------------
def file_identity(prefix: str) -> dict:
    """What a cached index of a corpus depends on: its path, sizes and the .idx's mtime."""
    stats = [os.stat(prefix + suffix) for suffix in (".idx", ".bin")]
    return {"prefix": os.path.realpath(prefix), "idx_bytes": stats[0].st_size, "bin_bytes": stats[1].st_size,
            "idx_mtime_ns": stats[0].st_mtime_ns}


def index_root(prefix: str, cache_dir: str | Path | None) -> Path:
    """Where sample indices are cached: ``cache_dir``, or ``_llmjp_index`` beside the corpus."""
    return Path(cache_dir) if cache_dir is not None else Path(prefix).resolve().parent / CACHE_DIR_NAME


@contextlib.contextmanager
def _build_lock(path: Path):
    """An exclusive flock on ``path`` if the filesystem supports it; correctness never depends on it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def ensure_cache_dir(root: Path) -> None:
    """Make the index cache directory ``root``; fail unless it can be written (a read-only data directory needs
    ``data.cache_dir``)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        writable = os.access(root, os.W_OK)
    except OSError:
        writable = False
    if not writable:
        fail(f"cannot write the sample index cache in {root}: set a writable cache_dir (data.cache_dir)")


class CachedIndex(dict):
    """Arrays memory-mapped from one cache directory; pickles as its path (DataLoader workers re-open it)."""

    def __init__(self, path: Path, arrays: dict):
        super().__init__(arrays)
        self.path = path

    def __reduce__(self):
        return (load_cached, (self.path,))


def load_cached(final: Path) -> CachedIndex:
    try:
        names = json.loads((final / "meta.json").read_text())["arrays"]
        return CachedIndex(final, {n: np.load(final / f"{n}.npy", mmap_mode="r") for n in names})
    except (OSError, ValueError, KeyError) as exc:
        fail(f"index cache {final} is unreadable ({exc}): delete that directory and start again")


def cached_arrays(root: Path, name: str, meta: dict, build: Callable[..., dict[str, np.ndarray]]) -> CachedIndex:
    """Load the arrays cached for ``meta`` under ``root``, or build, write atomically and load them (mmap).

    ``build(alloc)`` returns the arrays; ``alloc(name, shape, dtype)`` gives an array memory-mapped straight into
    the cache file, for outputs too big to hold in memory and then copy.
    """
    key = hashlib.sha256(json.dumps({"format": INDEX_FORMAT, **meta}, sort_keys=True).encode()).hexdigest()[:20]
    final = root / f"{name}-{key}"
    if (final / "meta.json").exists():
        return load_cached(final)
    ensure_cache_dir(root)
    with _build_lock(root / f".{name}-{key}.lock"):
        if (final / "meta.json").exists():  # another process built it while we waited
            return load_cached(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-{key}.", suffix=".tmp", dir=root))
        try:
            mapped: dict[str, np.memmap] = {}

            def alloc(array_name: str, shape, dtype) -> np.ndarray:
                mapped[array_name] = np.lib.format.open_memmap(tmp / f"{array_name}.npy", mode="w+", dtype=dtype,
                                                               shape=shape)
                return mapped[array_name]

            arrays = build(alloc)
            for n, a in arrays.items():
                if n in mapped:
                    mapped[n].flush()
                    with open(tmp / f"{n}.npy", "rb+") as f:
                        os.fsync(f.fileno())
                    continue
                with open(tmp / f"{n}.npy", "wb") as f:
                    np.save(f, a)
                    f.flush()
                    os.fsync(f.fileno())
            names = list(arrays)
            del arrays
            mapped.clear()  # drops the last references: the maps close before the rename
            with open(tmp / "meta.json", "w") as f:
                json.dump({**meta, "format": INDEX_FORMAT, "arrays": names}, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.rename(tmp, final)
            except OSError:  # lost a race with a builder that did not see the lock: theirs is as good
                if not (final / "meta.json").exists():
                    raise
            fsync_dir(root)
        finally:
            remove_quietly(tmp)
    return load_cached(final)


# -- one corpus, one split ----------------------------------------------------------------------------------
def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([int(k) for k in key])


def _smallest_int(limit: int):
    return np.int32 if limit < np.iinfo(np.int32).max else np.int64


def build_window_index(doc_lengths: np.ndarray, seq_len: int, seed: int, split_id: int, epochs: int) -> dict:
    """The sample index of one split: document order over ``epochs`` and each window's (stream doc, offset)."""
    n_docs = len(doc_lengths)
    total = int(doc_lengths.sum())
    per_epoch = (total - 1) // seq_len
    order = np.empty(epochs * n_docs, dtype=_smallest_int(n_docs))
    for e in range(epochs):
        order[e * n_docs:(e + 1) * n_docs] = _rng(seed, split_id, e).permutation(n_docs)
    ends = np.cumsum(doc_lengths[order], dtype=np.int64)
    starts = np.arange(epochs * per_epoch, dtype=np.int64) * seq_len
    doc = np.searchsorted(ends, starts, side="right")
    offset = starts - (ends[doc] - doc_lengths[order[doc]])
    del starts, ends
    shuffle = np.empty(epochs * per_epoch, dtype=np.int64)
    for b in range(epochs):
        shuffle[b * per_epoch:(b + 1) * per_epoch] = b * per_epoch + _rng(seed, split_id, b, 1).permutation(per_epoch)
    return {"order": order, "doc": doc[shuffle].astype(_smallest_int(len(order)), copy=False),
            "offset": offset[shuffle].astype(np.int32)}


class CorpusWindows:
    """``seq_len + 1``-token windows over documents ``[first, last)`` of one corpus (see the module docstring)."""

    def __init__(self, corpus: IndexedDataset, first: int, last: int, seq_len: int, seed: int, split_id: int,
                 num_samples: int, cache_dir: str | Path | None = None):
        self.corpus, self.first, self.last = corpus, first, last
        self.seq_len, self.seed, self.split_id = seq_len, seed, split_id
        self._spans()
        total = int(self.doc_lengths.sum())
        split = SPLIT_NAMES[split_id]
        if total < seq_len + 1:
            fail(f"the {split} split of corpus {corpus.prefix} ({last - first} documents) has {total} tokens, fewer "
                 f"than one sample of seq_len + 1 = {seq_len + 1}: give it more data, change the split, or set "
                 f"its samples to 0")
        self.per_epoch = (total - 1) // seq_len
        self.epochs = max(1, math.ceil(num_samples / self.per_epoch))
        meta = {"corpus": file_identity(corpus.prefix), "documents": [first, last], "seq_len": seq_len,
                "seed": seed, "split": split, "epochs": self.epochs}
        self.index = cached_arrays(index_root(corpus.prefix, cache_dir), f"{Path(corpus.prefix).name}-{split}",
                                   meta, lambda alloc: build_window_index(self.doc_lengths, seq_len, seed,
                                                                          split_id, self.epochs))
        self._bind()

    def _spans(self) -> None:
        starts, lengths = self.corpus.document_token_spans()
        self.doc_starts, self.doc_lengths = starts[self.first:self.last], lengths[self.first:self.last]

    def _bind(self) -> None:
        self.order, self.doc, self.offset = self.index["order"], self.index["doc"], self.index["offset"]

    def __getstate__(self) -> dict:  # pickles as paths (corpus prefix, cache dir), not as copies of arrays
        return {k: v for k, v in self.__dict__.items()
                if k not in ("order", "doc", "offset", "doc_starts", "doc_lengths")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._spans()
        self._bind()

    def __len__(self) -> int:
        return self.epochs * self.per_epoch

    def get(self, j: int) -> np.ndarray:
        need = self.seq_len + 1
        out = np.empty(need, dtype=np.int64)
        p, skip = int(self.doc[j]), int(self.offset[j])
        filled = 0
        tokens = self.corpus.tokens
        while filled < need:
            d = int(self.order[p])
            start, length = int(self.doc_starts[d]) + skip, int(self.doc_lengths[d]) - skip
            take = min(length, need - filled)
            out[filled:filled + take] = tokens[start:start + take]
            filled += take
            p += 1
            skip = 0
        return out


# -- blends -------------------------------------------------------------------------------------------------
def blend_assignment(weights: Sequence[float], num_samples: int, chunk: int = BLEND_CHUNK,
                     out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(corpus of each global sample, its index within that corpus) for the divisor-method blend.

    The ``k``-th sample of corpus ``c`` is due at ``(k + 0.5) / w_c``; samples go in order of due time, ties to
    the lower corpus index. Built in chunks (each a sort of ~``chunk`` candidates), so memory stays bounded
    when ``out`` is memory-mapped.
    """
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    live = np.flatnonzero(w > 0)
    if out is None:
        out = (np.empty(num_samples, dtype=np.int16 if len(w) < 32768 else np.int32),
               np.empty(num_samples, dtype=np.int64))
    corpus, index = out
    taken = np.zeros(len(w), dtype=np.int64)
    done = 0
    while done < num_samples:
        n = min(chunk, num_samples - done)
        # candidates: the next few samples of every corpus. Over the next n samples the due time advances by at
        # most n + C, so corpus c contributes at most (n + C) * w_c + 1 of them; a corpus whose candidates all got
        # picked might have had more to give, so then widen and redo.
        extra = np.ceil((n + len(live)) * w[live] + 2).astype(np.int64)
        while True:
            ks = [taken[c] + np.arange(extra[i], dtype=np.int64) for i, c in enumerate(live)]
            times = np.concatenate([(k + 0.5) / w[c] for k, c in zip(ks, live)])
            owner = np.concatenate([np.full(len(k), c, dtype=np.int64) for k, c in zip(ks, live)])
            pick = np.lexsort((owner, times))[:n]
            got = np.bincount(owner[pick], minlength=len(w))
            if np.all(got[live] < extra):
                break
            extra *= 2
        corpus[done:done + n] = owner[pick]
        index[done:done + n] = np.concatenate(ks)[pick]
        taken += got
        done += n
    return corpus, index


class SampleDataset:
    """``len(ds)`` samples; ``ds[i]`` -> int64 array of ``seq_len + 1`` tokens, deterministic in (blend, seed)."""

    def __init__(self, sources: list[CorpusWindows | None], weights: list[float], num_samples: int, seq_len: int,
                 blend: CachedIndex | None, name: str):
        self.sources, self.weights, self.num_samples = sources, weights, num_samples
        self.seq_len, self.name = seq_len, name
        self.blend = blend  # None: one corpus, global sample i is its sample i
        self._bind()

    def _bind(self) -> None:
        self._corpus_of = self.blend["corpus"] if self.blend is not None else None
        self._index_in_corpus = self.blend["index"] if self.blend is not None else None

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_corpus_of", "_index_in_corpus")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._bind()

    def __len__(self) -> int:
        return self.num_samples

    def source(self, i: int) -> tuple[int, int]:
        """(position of the corpus in the blend, sample index within that corpus's split) of global sample i."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for the {self.num_samples} {self.name} samples")
        if self._corpus_of is None:
            return next(c for c, s in enumerate(self.sources) if s is not None), i
        return int(self._corpus_of[i]), int(self._index_in_corpus[i])

    def __getitem__(self, i: int) -> np.ndarray:
        c, j = self.source(int(i))
        return self.sources[c].get(j)

    def __repr__(self) -> str:
        return f"SampleDataset({self.name}: {self.num_samples} samples of {self.seq_len + 1} tokens)"


def _document_ranges(n_docs: int, split: Sequence[float]) -> list[tuple[int, int]]:
    fractions = np.asarray(split, dtype=np.float64)
    if len(fractions) not in (2, 3) or np.any(fractions < 0) or fractions.sum() <= 0:
        fail(f"split {tuple(split)} must be 2 or 3 fractions >= 0 (train, valid[, test]), not all 0")
    bounds = np.round(np.cumsum(fractions / fractions.sum()) * n_docs).astype(np.int64)
    bounds[-1] = n_docs
    if fractions[0] > 0 and fractions[1] > 0 and n_docs >= 2:  # both splits get a document when they can
        bounds[0] = min(max(bounds[0], 1), n_docs - 1)
        bounds[1] = max(bounds[1], bounds[0] + 1)
    edges = [0, *bounds.tolist()]
    return [(edges[i], edges[i + 1]) for i in range(len(fractions))]


def check_vocab(ds: IndexedDataset, vocab_size: int, cache_dir) -> None:
    """Fail unless every token id of ``ds`` is below ``vocab_size`` (the largest id is cached beside the corpus)."""
    meta = {"corpus": file_identity(ds.prefix), "what": "max_token_id"}
    result = cached_arrays(index_root(ds.prefix, cache_dir), f"{Path(ds.prefix).name}-maxid", meta,
                           lambda alloc: {"max_token_id": np.array([ds.max_token_id()], dtype=np.int64)})
    top = int(result["max_token_id"][0])
    if top >= vocab_size:
        fail(f"corpus {ds.prefix} contains token id {top}, outside the model's vocabulary of {vocab_size}: it was "
             f"tokenized with another tokenizer; re-run `llmjp-ds preprocess` with this model's tokenizer")


def _build_split(corpora, weights, split_id, ranges, num_samples, seq_len, seed, cache_dir) -> SampleDataset:
    name = SPLIT_NAMES[split_id]
    if num_samples <= 0:
        return SampleDataset([None] * len(corpora), list(weights), 0, seq_len, None, name)
    live = [c for c, w in enumerate(weights) if w > 0]
    if len(live) == 1:
        c = live[0]
        first, last = ranges[c][split_id]
        sources: list[CorpusWindows | None] = [None] * len(corpora)
        sources[c] = CorpusWindows(corpora[c], first, last, seq_len, seed, split_id, num_samples, cache_dir)
        return SampleDataset(sources, list(weights), num_samples, seq_len, None, name)
    meta = {"corpora": [file_identity(ds.prefix) for ds in corpora], "weights": list(map(float, weights)),
            "samples": num_samples, "split": name}
    root = index_root(corpora[0].prefix, cache_dir)

    def build(alloc):
        corpus = alloc("corpus", (num_samples,), np.int16 if len(weights) < 32768 else np.int32)
        index = alloc("index", (num_samples,), np.int64)
        blend_assignment(weights, num_samples, out=(corpus, index))
        return {"corpus": corpus, "index": index}

    blend = cached_arrays(root, f"blend-{name}", meta, build)
    needed = np.bincount(blend["corpus"], minlength=len(corpora))  # corpus c's samples are 0..count-1
    sources = [CorpusWindows(ds, *ranges[c][split_id], seq_len, seed, split_id, int(needed[c]), cache_dir)
               if needed[c] > 0 else None for c, ds in enumerate(corpora)]
    return SampleDataset(sources, list(weights), num_samples, seq_len, blend, name)


def build_datasets(blend: Sequence[tuple[float, str]] | Sequence[str], seq_len: int, seed: int, train_samples: int,
                   valid_samples: int, split: Sequence[float] = (0.99, 0.01), cache_dir: str | Path | None = None,
                   barrier: Callable[[], None] | None = None, rank: int | None = None,
                   vocab_size: int | None = None) -> tuple[SampleDataset, SampleDataset]:
    """Train and valid datasets for a blend (``parse_blend`` output, or the raw Megatron-style strings).

    ``barrier`` (e.g. ``torch.distributed.barrier``): rank 0 (``rank``, default ``$RANK`` or 0) builds every
    index first and the other ranks load it after the barrier. Without it, concurrent builders are serialised by
    a file lock and the cache is still written atomically. ``vocab_size``: also check every token id fits.
    """
    if seq_len < 1:
        fail(f"seq_len {seq_len} must be >= 1")
    if train_samples < 0 or valid_samples < 0:
        fail(f"sample counts must be >= 0 (train {train_samples}, valid {valid_samples})")
    if blend and all(isinstance(item, str) for item in blend):
        blend = parse_blend(list(blend))
    if not blend:
        fail("empty data blend: give at least one corpus prefix")
    weights = [float(w) for w, _ in blend]
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    if barrier is not None and rank != 0:
        barrier()  # rank 0 builds and caches every index first
    corpora = [IndexedDataset(p) for _, p in blend]
    if vocab_size is not None:
        for ds in corpora:
            check_vocab(ds, vocab_size, cache_dir)
    ranges = [_document_ranges(ds.num_documents, split) for ds in corpora]
    train = _build_split(corpora, weights, 0, ranges, train_samples, seq_len, seed, cache_dir)
    valid = _build_split(corpora, weights, 1, ranges, valid_samples, seq_len, seed, cache_dir)
    if barrier is not None and rank == 0:
        barrier()
    return train, valid
