"""What a run reads: the configured blend and tokenizer, or the bundled corpus prepared once and cached.

The bundled default (no ``data.blend``): a SentencePiece tokenizer trained on the bundled corpus and the corpus
preprocessed to ``.bin/.idx``, cached under ``$LLMJP_DS_CACHE`` (default ``~/.cache/llmjp-ds``) and keyed by the
corpus files' contents, so every run and every rank reuses one copy. Concurrent ranks serialise on a file lock.
The tokenizer is copied into ``<run_dir>/tokenizer`` so export ships it with the model.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from llmjp_ds.data import bundled_corpus_files
from llmjp_ds.data.tokenizer import load_tokenizer, resolve_model_path, save_hf_tokenizer, train_tokenizer
from llmjp_ds.errors import UserError, fail
from llmjp_ds.io_utils import one_line_write_errors

BUNDLED_VOCAB = 8000


def cache_root() -> Path:
    return Path(os.environ.get("LLMJP_DS_CACHE", Path.home() / ".cache" / "llmjp-ds"))


def _bundled_key(files) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def prepare_bundled(vocab_size: int = BUNDLED_VOCAB) -> tuple[list[tuple[float, str]], Path]:
    """(blend, tokenizer dir) of the bundled corpus, built on first use.

    Each language is its own corpus (``ja``, ``en``, ``code``) blended by token count, as LLM-jp weights its
    corpora, so each has its own train/valid split and the validation set holds all three."""
    from llmjp_ds.data.indexed import IndexedDataset
    from llmjp_ds.data.preprocess import preprocess

    files = bundled_corpus_files()
    root = cache_root() / f"bundled-{_bundled_key(files)}-v{vocab_size}"
    root.mkdir(parents=True, exist_ok=True)
    blend = []
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # tokenizer.json is what train_tokenizer writes last: a kill before it leaves a tokenizer to redo
        if not (root / "tokenizer" / "tokenizer.json").is_file():
            train_tokenizer(files, root / "tokenizer", vocab_size=vocab_size, force=True)
        for f in files:
            prefix = root / f.name.split(".")[0]
            if not Path(f"{prefix}_text_document.idx").is_file():
                preprocess([f], root / "tokenizer", prefix, workers=1, force=True)
            blend.append((float(IndexedDataset(f"{prefix}_text_document").num_tokens), f"{prefix}_text_document"))
    return blend, root / "tokenizer"


@dataclass
class DataPlan:
    blend: list  # [(weight, prefix)]
    tokenizer_dir: Path | None
    vocab_size: int | None
    split: list
    seed: int
    cache_dir: str | None
    order: str = "llmjp"  # llmjp (data/dataset.py) | megatron (data/megatron_order.py)
    weighted: bool = True  # the blend gave weights (False: prefixes alone, Megatron's "no weights")
    test_samples: int = 0  # megatron: the test split's size Megatron-LM asks for (its cache files' names hold it)
    eod_id: int | None = None

    def build(self, seq_len: int, train_samples: int, valid_samples: int, barrier=None):
        """(train, valid) datasets: ``ds[i]`` is global sample i's ``seq_len + 1`` tokens. Under megatron every
        rank of a process group must call it together (megatron-core's builder has its own barriers)."""
        if self.order == "megatron":
            from llmjp_ds.data.megatron_order import build_megatron_datasets

            return build_megatron_datasets(self.blend, self.weighted, seq_len, self.seed,
                                           (train_samples, valid_samples, self.test_samples), self.split,
                                           self.cache_dir, self.eod_id, self.vocab_size, self.tokenizer_dir)
        from llmjp_ds.data.dataset import build_datasets

        return build_datasets(self.blend, seq_len, self.seed, train_samples, valid_samples, split=tuple(self.split),
                              cache_dir=self.cache_dir, barrier=barrier, vocab_size=self.vocab_size)

    def install_tokenizer(self, run_dir) -> None:
        """Copy the tokenizer into ``<run_dir>/tokenizer`` (once per run; a lock serialises concurrent callers)."""
        if self.tokenizer_dir is None:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / ".tokenizer.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            _install_tokenizer(self.tokenizer_dir, run_dir)


def _refuse_links_out(source: Path) -> None:
    """One line for a link in tokenizer directory ``source`` to a file or directory outside it, which a copy
    would bring into the run as its own."""
    root = source.resolve()
    for parent, dirs, files in os.walk(source):
        for path in (Path(parent) / name for name in dirs + files):
            if path.is_symlink() and not path.resolve().is_relative_to(root):
                fail(f"tokenizer directory {source}: {path.relative_to(source)} is a link to {path.resolve()}, "
                     "outside it: copy that file into the directory, or pass the tokenizer.model itself")


def _install_tokenizer(source: Path, run_dir: Path) -> Path:
    """Copy the tokenizer into the run directory as HF files (``AutoTokenizer``-loadable) + tokenizer.model."""
    target = run_dir / "tokenizer"
    if (target / "tokenizer_config.json").is_file():
        return target
    # built beside and renamed into place: a kill leaves no tokenizer/ or a complete one, never a partial one; a full
    # disk leaves neither
    tmp = run_dir / ".tokenizer.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with one_line_write_errors(target, "free space or choose another run_dir, then start again"):
            if source.is_dir() and (source / "tokenizer_config.json").is_file() and \
                    (source / "tokenizer.model").is_file():
                _refuse_links_out(source)
                shutil.copytree(source, tmp)  # a link inside it: its target's content, copied as a file
            else:
                save_hf_tokenizer(resolve_model_path(source), tmp)
    except UserError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(target, ignore_errors=True)  # an incomplete one written in place by an older version
    os.replace(tmp, target)
    return target


def resolve_data(blend, tokenizer, model_vocab_size: int, split, seed: int, cache_dir=None, order: str = "llmjp",
                 test_samples: int = 0) -> DataPlan:
    """The blend and tokenizer of a run; checks the tokenizer fits the model's embedding (``model_vocab_size``
    rows) and every corpus fits the vocabulary. ``blend`` is Megatron-style ``[weight, prefix, ...]`` (or
    prefixes alone); empty means the bundled corpus and its own tokenizer. ``order`` and ``test_samples``: see
    :class:`DataPlan`. Writes nothing into the run directory (:meth:`DataPlan.install_tokenizer` does, once the
    trainer knows the directory is shared)."""
    from llmjp_ds.data.dataset import blend_has_weights, check_vocab, parse_blend
    from llmjp_ds.data.indexed import IndexedDataset

    weighted = True  # the bundled corpora are weighted by their token counts
    if blend:
        weighted = blend_has_weights(list(map(str, blend)))
        blend = parse_blend(list(map(str, blend)))
        tokenizer = Path(tokenizer) if tokenizer else None
    else:
        blend, tokenizer = prepare_bundled()
    if order == "megatron" and weighted and any(w <= 0 for w, _ in blend):
        fail("data.blend has a weight of 0: Megatron's builder needs every weight > 0; leave that corpus out of the "
             "blend, or set data.order=llmjp")
    vocab = eod = None
    if tokenizer is not None:
        if not tokenizer.exists():
            fail(f"data.tokenizer {tokenizer} does not exist: pass a SentencePiece .model or an HF tokenizer dir")
        loaded = load_tokenizer(tokenizer)
        vocab, eod = loaded.vocab_size, loaded.eod_id
        if vocab > model_vocab_size:
            fail(f"the tokenizer has {vocab} pieces but the model's embedding only {model_vocab_size} rows: "
                 f"set model.overrides.vocab_size to at least {vocab} (padded: a multiple of 128)")
    # open every corpus now: a truncated .bin/.idx, an unknown dtype code or token ids beyond the vocabulary
    # fail here, before anything is written and before any process group exists (not in data.build())
    for _, prefix in blend:
        check_vocab(IndexedDataset(prefix), vocab or model_vocab_size, cache_dir)
    if order == "megatron":
        from llmjp_ds.data.megatron_order import check_split_tokens

        check_split_tokens([p for _, p in blend], split)
    return DataPlan(blend, tokenizer, vocab, list(split), seed, cache_dir, order, weighted, test_samples, eod)
