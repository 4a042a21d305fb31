"""``data.order: megatron``: Megatron-LM's samples, made by megatron-core's own dataset code.

Megatron-LM's ``pretrain_gpt.py`` builds its data as ``BlendedMegatronDatasetBuilder(GPTDataset, sizes,
is_built_on_rank, GPTDatasetConfig(...)).build()``; :func:`build_megatron_datasets` makes the same call, with

* the blend as ``get_blend_from_list`` makes it from ``--data-path``: ``(prefixes, weights)``, weights ``None``
  for prefixes given alone (each corpus then contributes one epoch, blended by its length);
* the sizes of ``get_train_valid_test_num_samples`` (:func:`llmjp_ds.config.megatron_sample_counts`);
* every other ``GPTDatasetConfig`` field that pretrain_gpt.py fills from its arguments, at the arguments' default
  values (:data:`MEGATRON_LM_ARGS`), ``--seed`` = ``data.seed`` and ``--split`` = ``data.split``;
* a tokenizer stand-in: the config reads ``eod`` and ``pad`` (masks and padding only) and ``unique_identifiers``
  (part of the cache files' names); the trainer reads the raw windows, which none of them changes.

Sample ``i`` of a split is then the raw window (``seq_len + 1`` tokens) megatron-core's dataset gives for index
``i`` (:mod:`llmjp_ds.data.megatron_internals`), and the trainer reads index ``i`` where Megatron-LM's
``MegatronPretrainingSampler`` does (:mod:`llmjp_ds.data.batching`).

The indices are megatron-core's own cache files, in ``data.cache_dir`` when it is set (a Megatron-LM
``--data-cache-path`` is reused as it is) or in ``_llmjp_index/megatron-<key>/`` beside the first corpus, the key
covering the corpora's sizes and mtimes (Megatron's file names cover their paths only). megatron-core asks
``torch.distributed`` for the rank: inside a run every rank calls the builder together (rank 0 builds, the others
load after its barrier); outside one (``llmjp-ds samples``, tests) a one-process gloo group is made for the call.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np

from llmjp_ds.data import megatron_internals
from llmjp_ds.data.dataset import ensure_cache_dir, file_identity, index_root
from llmjp_ds.data.indexed import sequence_lengths
from llmjp_ds.errors import fail

# GPTDatasetConfig fields pretrain_gpt.py (core_gpt_dataset_config_from_args, Megatron-LM core_v0.16.1 and the
# 0.19 line) fills from its arguments, at the arguments' defaults; a field the installed megatron-core lacks is
# left out, one it has and this table lacks keeps its dataclass default, as Megatron-LM of that version would
MEGATRON_LM_ARGS = {
    "blend_per_split": None, "multiple_validation_sets": False, "full_validation": False,
    "num_dataset_builder_threads": 1, "mmap_bin_files": True, "reset_position_ids": False,
    "reset_attention_mask": False, "eod_mask_loss": False, "create_attention_mask": True,
    "object_storage_cache_path": None, "mid_level_dataset_surplus": 0.005, "allow_ambiguous_pad_tokens": False,
    "fast_cache_load": False, "sequences_per_dataset": None, "defer_npy_index_mmap": False,
    "context_parallel_size": 1, "sequence_parallel_size": 0, "hybrid_context_parallel": False,
    "inter_document_masking": False,
}
SPLITS = ("train", "valid", "test")


class TokenizerStandIn:
    """What GPTDatasetConfig reads of Megatron-LM's tokenizer. ``pad`` is megatron-core's own "no pad" id (-1, in
    no corpus), so its pad-versus-eod check stays quiet; with the default ``drop_last_partial_validation_sequence``
    no window is ever padded. ``unique_identifiers`` enters the hash in the cache files' names."""

    pad = -1

    def __init__(self, eod: int | None, vocab_size: int | None, identity: dict):
        self.eod, self.vocab_size = eod, vocab_size
        self.unique_identifiers = OrderedDict(identity)


def split_text(split) -> str:
    """``data.split`` as Megatron-LM's ``--split``: ``[99990, 8, 2]`` -> ``"99990,8,2"``."""
    return ",".join(str(int(x)) if float(x).is_integer() else np.format_float_positional(float(x), trim="-")
                    for x in split)


def cache_location(prefixes: list[str], cache_dir) -> Path:
    """``data.cache_dir`` as it is, or ``_llmjp_index/megatron-<key>`` beside the first corpus."""
    if cache_dir:
        return Path(cache_dir)
    key = hashlib.sha256(json.dumps([file_identity(p) for p in prefixes]).encode()).hexdigest()[:16]
    return index_root(prefixes[0], None) / f"megatron-{key}"


def cached_identity(path: Path, prefixes: list[str], seed: int, seq_len: int, matrix) -> tuple[dict, str] | None:
    """(tokenizer identity, ``--split`` text) of the GPTDataset indices cached in ``path`` for these corpora,
    seed, seq_len and split matrix, when exactly one such pair is there. Both name Megatron's cache files (their
    hash) and change no window: taking them over makes a Megatron-LM cache directory's files ours."""
    want = json.loads(json.dumps(matrix))
    found = {}
    for description in path.glob("*-GPTDataset-*-description.txt"):
        try:
            d = json.loads(description.read_text())
        except (OSError, ValueError):
            continue
        if (isinstance(d, dict) and d.get("dataset_path") in prefixes and d.get("random_seed") == seed
                and d.get("sequence_length") == seq_len and d.get("split_matrix") == want
                and isinstance(d.get("tokenizer"), dict) and isinstance(d.get("split"), str)):
            found[json.dumps([d["tokenizer"], d["split"]])] = (d["tokenizer"], d["split"])
    return next(iter(found.values())) if len(found) == 1 else None


def split_matrix(split) -> list:
    """Megatron's split matrix of ``data.split``: each split's [begin, end) share, None for a split with none."""
    config = megatron_internals.datasets().config
    return config.convert_split_vector_to_split_matrix(config.parse_and_normalize_split(split_text(split)))


def check_split_tokens(prefixes: list[str], split) -> None:
    """Each split with a share must hold tokens in every corpus: megatron-core's epoch count loops forever on an
    empty one. Its split is by sequence: ``round(bound * sequences)``. Run before any process group, on corpora
    already opened (checked) once."""
    matrix = split_matrix(split)
    for prefix in prefixes:
        lengths = sequence_lengths(prefix)
        for name, bounds in zip(SPLITS, matrix):
            if bounds is None:
                continue
            first, last = (int(round(b * float(len(lengths)))) for b in bounds)
            if not int(lengths[first:last].sum()):
                fail(f"the {name} split of corpus {prefix} (sequences {first}..{last} of {len(lengths)}) holds no "
                     f"tokens, and Megatron's builder would loop forever on it: give that corpus more documents or "
                     f"change data.split")


@contextlib.contextmanager
def process_group():
    """The run's process group, or a one-process gloo group made for the builder and ended after it."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        yield
        return
    hook = sys.excepthook  # init_process_group wraps it to prefix tracebacks with the rank; the group is ours
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


def _from_rank0(read):
    """``read()`` on rank 0, the same value on every rank: rank 0 may be writing the cache while others look."""
    import torch.distributed as dist

    box = [read() if dist.get_rank() == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _config(gpt, seed: int, seq_len: int, blend, split: str, path: Path, tokenizer):
    known = set(gpt.GPTDatasetConfig.__dataclass_fields__)
    return gpt.GPTDatasetConfig(random_seed=seed, sequence_length=seq_len, blend=blend, split=split,
                                path_to_cache=str(path), tokenizer=tokenizer,
                                **{k: v for k, v in MEGATRON_LM_ARGS.items() if k in known})


def build_megatron_datasets(blend: list[tuple[float, str]], weighted: bool, seq_len: int, seed: int, sizes,
                            split, cache_dir=None, eod: int | None = None, vocab_size: int | None = None,
                            tokenizer_path=None):
    """(train, valid) :class:`MegatronSamples` of Megatron-LM's builder for ``blend`` (``[(weight, prefix)]``;
    ``weighted`` False: prefixes given alone, Megatron's "no weights") and ``sizes`` = (train, valid, test)."""
    mc = megatron_internals.datasets()
    prefixes = [p for _, p in blend]
    mc_blend = (prefixes, [float(w) for w, _ in blend] if weighted else None)
    path = cache_location(prefixes, cache_dir)
    ensure_cache_dir(path)
    identity = {"class": "llmjp_ds.data.tokenizer.Tokenizer",
                "tokenizer_path": [str(tokenizer_path)] if tokenizer_path else []}
    try:
        with process_group():  # the config too: megatron-core 0.19 asks for the rank when it logs
            config = _config(mc.gpt, seed, seq_len, mc_blend, split_text(split), path,
                             TokenizerStandIn(eod, vocab_size, identity))
            megatron_cache = _from_rank0(lambda: cached_identity(path, prefixes, seed, seq_len, config.split_matrix))
            if megatron_cache is not None:
                config = _config(mc.gpt, seed, seq_len, mc_blend, megatron_cache[1], path,
                                 TokenizerStandIn(eod, vocab_size, megatron_cache[0]))
            built = mc.builder.BlendedMegatronDatasetBuilder(mc.gpt.GPTDataset, list(sizes), lambda: True,
                                                             config).build()
    except (OSError, ValueError) as exc:  # a cache file cut by a kill or not megatron-core's, or one a node cannot see
        fail(f"cannot read or write Megatron's sample index cache in {path} ({exc}): a file there is damaged (a build "
             f"that was killed) or not megatron-core's: delete it, it is rebuilt; on several nodes, data.cache_dir "
             f"must be on a filesystem every node mounts")
    out = [MegatronSamples(ds, n, seq_len, name, path, reused=megatron_cache is not None)
           for ds, n, name in zip(built, sizes, SPLITS)]
    for samples in out[:2]:
        samples.check_size()
    return out[0], out[1]


class MegatronSamples:
    """One split of Megatron's samples as the trainer reads them: ``ds[i]`` is the int64 window (``seq_len + 1``
    tokens) of Megatron's sample ``i``, ``len(ds)`` the samples the run reads (megatron-core's dataset may hold
    more: whole epochs, and the blend's surplus)."""

    def __init__(self, top, num_samples: int, seq_len: int, name: str, cache_dir: Path, reused: bool = False):
        self.top, self.num_samples, self.seq_len, self.name = top, int(num_samples), seq_len, name
        self.cache_dir, self.reused = cache_dir, reused

    def check_size(self) -> None:
        held = 0 if self.top is None else len(self.top)
        if held < self.num_samples:
            fix = "or lower train.steps" if self.name == "train" else \
                "a larger valid share in data.split, or fewer train.eval_batches"
            fail(f"Megatron's {self.name} split of this blend holds {held} samples, fewer than the {self.num_samples} "
                 f"the run reads: prefixes without weights are each taken once; give data.blend weights (Megatron "
                 f"then repeats corpora), {fix}")

    def __len__(self) -> int:
        return self.num_samples

    def source(self, i: int) -> tuple[int, int]:
        """(position of the corpus in the blend, sample index in its GPTDataset) of sample ``i``."""
        corpus, _, j = self._source(i)
        return corpus, j

    def _source(self, i: int):
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for the {self.num_samples} {self.name} samples")
        return megatron_internals.sample_source(self.top, i)

    def __getitem__(self, i: int) -> np.ndarray:
        _, mid, j = self._source(int(i))
        return megatron_internals.window(mid, j)

    def __repr__(self) -> str:
        return f"MegatronSamples({self.name}: {self.num_samples} samples of {self.seq_len + 1} tokens)"
