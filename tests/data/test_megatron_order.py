"""``data.order: megatron`` against megatron-core's builder called as Megatron-LM calls it, token for token.

The reference is written here from Megatron-LM itself, not from our code: ``pretrain_gpt.py``'s
``core_gpt_dataset_config_from_args`` (a ``GPTDatasetConfig`` from the arguments' defaults, the blend from
``get_blend_from_list``), ``training.py``'s ``get_train_valid_test_num_samples`` (the sizes), ``data_samplers.py``'s
``MegatronPretrainingSampler`` (which rank reads which sample) and an evaluation loop that never restarts its
validation iterator. Its windows come through megatron-core's public ``__getitem__`` (tokens and labels); ours come
through what the trainer calls: ``trainer.data_plan(...).build`` with ``config.sample_counts``, then
``batching.step_micro_batches`` for each data-parallel rank and ``batching.validation_starts`` for each validation,
and through ``llmjp-ds samples``. The two builds use separate cache directories. A planted off-by-one in the
sample index, and one in the validation's start, must each be caught. Runs unchanged under megatron-core 0.16
(Python 3.11) and 0.19 (Python 3.12).
"""

from __future__ import annotations

import types

import numpy as np
import pytest

from tests.data.data_helpers import megatron_datasets, random_documents, write_corpus

SEQ, SEED, GBS, MBS, DP, STEPS, EVAL_INTERVAL, EVAL_ITERS = 32, 1234, 8, 2, 2, 12, 4, 2
GAS = GBS // (MBS * DP)
SPLIT = [90, 8, 2]


@pytest.fixture(scope="module")
def megatron():
    builder, gpt, utils = megatron_datasets("blended_megatron_dataset_builder", "gpt_dataset", "utils")
    return types.SimpleNamespace(builder=builder, gpt=gpt, utils=utils)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> list[str]:
    """Three corpora of random ids (documents of 0-199 tokens; the windows cross document boundaries)."""
    d = tmp_path_factory.mktemp("megatron_order")
    rng = np.random.default_rng(7)
    return [write_corpus(d / f"{name}_text_document", random_documents(rng, n, 1000))
            for name, n in (("a", 400), ("b", 250), ("c", 150))]


class Llama2TokenizerLike:
    """What Megatron-LM's ``_Llama2Tokenizer`` of LLM-jp's model hands GPTDatasetConfig: eod = eos = 2 and pad =
    ``sp.pad_id()`` = -1 (the v3 model has no SentencePiece pad id), and its identity (in the cache files' names)."""

    eod, pad, vocab_size = 2, -1, 99574

    def __init__(self):
        self.unique_identifiers = {"class": "_Llama2Tokenizer", "tokenizer_path": ["/models/llm-jp-v3.model"]}


def megatron_lm_datasets(megatron, data_path: list[str], split: str, cache, train_samples: int | None = None) -> tuple:
    """(train, valid) as Megatron-LM's pretrain_gpt.py builds them for ``--data-path data_path --split split``,
    ``--train-iters STEPS --global-batch-size GBS --eval-interval EVAL_INTERVAL --eval-iters EVAL_ITERS``
    (``train_samples``: a train split of that size, as ``--train-samples`` or a phase's share asks for)."""
    import torch.distributed as dist

    sizes = [train_samples or STEPS * GBS, (STEPS // EVAL_INTERVAL + 1) * EVAL_ITERS * GBS, EVAL_ITERS * GBS]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        config = megatron.gpt.GPTDatasetConfig(
            random_seed=SEED, sequence_length=SEQ, blend=megatron.utils.get_blend_from_list(data_path),
            blend_per_split=None, split=split, multiple_validation_sets=False, full_validation=False,
            num_dataset_builder_threads=1, path_to_cache=str(cache), mmap_bin_files=True,
            tokenizer=Llama2TokenizerLike(), reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
            create_attention_mask=True, mid_level_dataset_surplus=0.005, allow_ambiguous_pad_tokens=False)
        train, valid, _ = megatron.builder.BlendedMegatronDatasetBuilder(
            megatron.gpt.GPTDataset, sizes, lambda: True, config).build()
    finally:
        dist.destroy_process_group()
    return train, valid


def public_window(dataset, i: int) -> np.ndarray:
    """Sample ``i`` as Megatron-LM's training step receives it: tokens, and the last label."""
    item = dataset[i]
    return np.concatenate([item["tokens"].numpy(), item["labels"].numpy()[-1:]])


def sampler(total: int, consumed: int, rank: int):
    """``MegatronPretrainingSampler.__iter__`` (drop_last): the micro-batches of ``rank``, one after another."""
    batch = []
    for idx in range(consumed, total):
        batch.append(idx)
        if len(batch) == MBS * DP:
            yield batch[rank * MBS:(rank + 1) * MBS]
            batch = []


def megatron_lm_reads(train, valid, start: int) -> list[np.ndarray]:
    """Every micro-batch Megatron-LM's ranks read from iteration ``start`` on (a resume there: its train sampler at
    ``start * GBS``, its valid sampler at ``start // EVAL_INTERVAL * EVAL_ITERS * GBS``), in order: per iteration
    each rank's GAS training micro-batches, after an evaluation iteration each rank's EVAL_ITERS * GAS."""
    train_it = [sampler(len(train), start * GBS, r) for r in range(DP)]
    valid_it = [sampler(len(valid), start // EVAL_INTERVAL * EVAL_ITERS * GBS, r) for r in range(DP)]
    out = []
    for iteration in range(start + 1, STEPS + 1):
        for r in range(DP):
            out += [np.stack([public_window(train, i) for i in next(train_it[r])]) for _ in range(GAS)]
        if iteration % EVAL_INTERVAL == 0:
            for r in range(DP):
                out += [np.stack([public_window(valid, i) for i in next(valid_it[r])])
                        for _ in range(EVAL_ITERS * GAS)]
    return out


def run_config(blend: list[str], cache, *more: str):
    from llmjp_ds.config import load_config

    sets = ["data.order=megatron", f"data.blend=[{', '.join(blend)}]", f"data.seq_len={SEQ}", f"data.seed={SEED}",
            f"data.split={SPLIT}", f"data.cache_dir={cache}", f"train.steps={STEPS}", f"train.global_batch_size={GBS}",
            f"train.micro_batch_size={MBS}", f"train.eval_interval={EVAL_INTERVAL}", f"train.eval_batches={EVAL_ITERS}"]
    return load_config(None, sets + list(more))


def trainer_datasets(cfg) -> tuple:
    """(train, valid) as ``Trainer.setup`` builds them."""
    from llmjp_ds.config import model_config_of, sample_counts, seq_len_of
    from llmjp_ds.trainer import data_plan

    model_config = model_config_of(cfg)
    return data_plan(cfg, model_config).build(seq_len_of(cfg, model_config), *sample_counts(cfg))


def our_reads(cfg, train, valid, start: int) -> list[np.ndarray]:
    """The same micro-batches as the trainer's ranks read them: ``step_micro_batches`` at each step's consumed
    samples, and after each evaluation step the micro-batches of ``validation_starts``' global batches."""
    from llmjp_ds.data import batching

    def windows(batches):
        return [np.concatenate([x.numpy(), y.numpy()[:, -1:]], axis=1) for x, y in batches]

    out = []
    for step in range(start, STEPS):
        out += [w for r in range(DP) for w in windows(batching.step_micro_batches(train, step * GBS, GAS, MBS, r, DP))]
        if (step + 1) % EVAL_INTERVAL == 0:
            starts = batching.validation_starts(cfg.data.order, step + 1, EVAL_INTERVAL, EVAL_ITERS, GBS)
            out += [w for r in range(DP) for s in starts
                    for w in windows(batching.step_micro_batches(valid, s, GAS, MBS, r, DP))]
    return out


def first_difference(ours: list[np.ndarray], theirs: list[np.ndarray]) -> int | None:
    assert len(ours) == len(theirs) and all(len(a) == MBS for a in ours)
    return next((k for k, (a, b) in enumerate(zip(ours, theirs)) if not np.array_equal(a, b)), None)


BLENDS = {
    "weighted": lambda c: ["30", c[0], "50", c[1], "20", c[2]],  # BlendedDataset of sizes with the surplus
    "prefixes": lambda c: [c[0], c[1]],  # no weights: one epoch each, blended by their lengths
}


@pytest.mark.parametrize("blend_name", sorted(BLENDS))
def test_the_trainer_reads_megatron_lm_samples(megatron, corpora, blend_name, tmp_path, monkeypatch):
    from llmjp_ds.data import batching
    from llmjp_ds.data import megatron_internals

    blend = BLENDS[blend_name](corpora)
    ref_train, ref_valid = megatron_lm_datasets(megatron, blend, ",".join(map(str, SPLIT)), tmp_path / "megatron")
    cfg = run_config(blend, tmp_path / "ours")
    train, valid = trainer_datasets(cfg)
    assert not train.reused  # built apart from the reference's files
    assert type(train.top).__name__ == "BlendedDataset"
    for start in (0, 5):  # a fresh run, and a resume after iteration 5 (train at 40, valid at 16)
        theirs = megatron_lm_reads(ref_train, ref_valid, start)
        assert first_difference(our_reads(cfg, train, valid, start), theirs) is None, f"resume at {start}"

    theirs = megatron_lm_reads(ref_train, ref_valid, 5)
    window = megatron_internals.window
    monkeypatch.setattr(megatron_internals, "window", lambda mid, j: window(mid, j + 1))
    assert first_difference(our_reads(cfg, train, valid, 5), theirs) == 0  # a sample index off by one
    monkeypatch.setattr(megatron_internals, "window", window)
    starts = batching.validation_starts
    monkeypatch.setattr(batching, "validation_starts", lambda *a: [s + 1 for s in starts(*a)])
    # the first validation micro-batch: after the training micro-batches of iterations 6, 7 and 8
    assert first_difference(our_reads(cfg, train, valid, 5), theirs) == (8 - 5) * DP * GAS


def test_the_samples_verb_writes_the_windows_of_either_order(megatron, corpora, tmp_path):
    from llmjp_ds.samples import cli_main

    blend = BLENDS["weighted"](corpora)
    ref_train, ref_valid = megatron_lm_datasets(megatron, blend, ",".join(map(str, SPLIT)), tmp_path / "megatron")
    base = ["--set", "data.order=megatron", "--set", f"data.blend=[{', '.join(blend)}]", "--set", f"data.seq_len={SEQ}",
            "--set", f"data.split={SPLIT}", "--set", f"data.cache_dir={tmp_path / 'ours'}", "--set",
            f"train.steps={STEPS}", "--set", f"train.global_batch_size={GBS}", "--set",
            f"train.eval_interval={EVAL_INTERVAL}", "--set", f"train.eval_batches={EVAL_ITERS}"]
    base += ["--set", f"run_dir={tmp_path / 'run'}"]
    for split, ref, start, count in (("train", ref_train, 40, 9), ("valid", ref_valid, 16, 16)):
        out = tmp_path / f"{split}.npy"
        assert cli_main(base + ["--split", split, "--start", str(start), "--count", str(count), "--output",
                                str(out)]) == 0
        got = np.load(out)
        assert got.shape == (count, SEQ + 1) and got.dtype == np.int64
        assert np.array_equal(got, np.stack([public_window(ref, i) for i in range(start, start + count)]))
    # the llmjp order: the windows of the datasets the trainer builds under it
    out = tmp_path / "llmjp.npy"
    assert cli_main(base + ["--set", "data.order=llmjp", "--start", "40", "--count", "9", "--output", str(out)]) == 0
    train, _ = trainer_datasets(run_config(blend, tmp_path / "ours", "data.order=llmjp"))
    assert np.array_equal(np.load(out), np.stack([train[i] for i in range(40, 49)]))
    assert not np.array_equal(np.load(out), np.load(tmp_path / "train.npy"))  # the orders differ
    assert not (tmp_path / "run").exists()  # nothing written into the run directory


@pytest.mark.parametrize("blend_name", sorted(BLENDS))
def test_a_megatron_cache_directory_is_reused(megatron, corpora, blend_name, tmp_path):
    """data.cache_dir at a Megatron-LM --data-cache-path: its index files (named by its tokenizer and its --split
    text) are read and none is added or rewritten, and the windows are the reference's. The files' names hash
    every size the builder was asked for (each split's, each corpus's with the blend's surplus), so this also pins
    the sizes exactly where tiny corpora would give the same windows for a slightly different size."""
    blend = BLENDS[blend_name](corpora)
    cache = tmp_path / "megatron"
    ref_train, ref_valid = megatron_lm_datasets(megatron, blend, "90, 8, 2", cache)

    def megatron_files():
        return {p.name: p.stat().st_mtime_ns for p in cache.iterdir() if "Dataset-" in p.name}

    before = megatron_files()
    cfg = run_config(blend, cache)
    train, valid = trainer_datasets(cfg)
    assert train.reused and valid.reused
    corpora_used = len(blend) // 2 if blend_name == "weighted" else len(blend)
    assert megatron_files() == before and len(before) == corpora_used * 3 * 4 + 3 * 3  # GPTDatasets, 3 blends
    assert first_difference(our_reads(cfg, train, valid, 0), megatron_lm_reads(ref_train, ref_valid, 0)) is None


def test_a_split_without_tokens_fails_before_megatron_core_loops_on_it(megatron, corpora, tmp_path):
    """megatron-core's epoch count never ends on a split share that rounds to no sequence (150 documents, valid
    share 1/1000): refused with one line, before any process group."""
    from llmjp_ds.data.plan import resolve_data
    from llmjp_ds.errors import UserError

    with pytest.raises(UserError, match=r"the valid split of corpus .*c_text_document \(sequences 150\.\.150 of 150\) "
                                        r"holds no tokens, and Megatron's builder would loop forever on it"):
        resolve_data([corpora[2]], None, 1000, [999, 1], SEED, str(tmp_path), "megatron")
    resolve_data([corpora[2]], None, 1000, [99, 1], SEED, str(tmp_path), "megatron")  # 2 documents: fine


class _Planted:
    """An object whose unpickling writes a file: what a crafted cache file could run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickled_cache_file_is_refused_unread(megatron, corpora, tmp_path):
    """A cache file holding objects (a crafted one, in a shared --data-cache-path) must never be unpickled:
    megatron-core opens every cached index with numpy.load(mmap_mode="r"), which refuses object arrays before any
    pickle is read (0.16 passes allow_pickle=True, so without the memory map the pickle would run). The run ends
    with one line, and the planted code has not run."""
    from llmjp_ds.errors import UserError

    blend = BLENDS["weighted"](corpora)
    cache = tmp_path / "megatron"
    megatron_lm_datasets(megatron, blend, ",".join(map(str, SPLIT)), cache)
    target = sorted(cache.glob("*-GPTDataset-train-shuffle_index.npy"))[0]
    marker = tmp_path / "ran"
    np.save(target, np.array([_Planted(marker)], dtype=object), allow_pickle=True)
    with pytest.raises(UserError, match="cannot read or write Megatron's sample index cache in .*megatron"):
        trainer_datasets(run_config(blend, cache))
    assert not marker.exists()


def test_megatron_core_problem_names_a_missing_or_old_megatron_core(monkeypatch):
    """What validate_run says under data.order=megatron (the catalogue's megatron-core-missing runs it end to end)."""
    import importlib.metadata
    import importlib.util

    from llmjp_ds.data import megatron_internals

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.15.0")
    assert megatron_internals.megatron_core_problem() == (
        "megatron-core 0.15.0 is older than 0.16, the first version its dataset code was checked against")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert megatron_internals.megatron_core_problem().startswith("megatron-core is not importable")


def test_importing_megatron_core_leaves_torchs_allowlist_alone():
    """megatron.core's import registers its classes (argparse.Namespace, numpy's array rebuilder, its enums, ...)
    as safe for every later torch.load(weights_only=True); the megatron order's import takes them back, so a
    resume under it vets checkpoints with the project's allowlist. In a fresh interpreter: megatron imported once."""
    import sys

    from tests.launch import run

    code = ("import torch; from llmjp_ds.data import megatron_internals; megatron_internals.datasets(); "
            "from megatron.core.safe_globals import SAFE_GLOBALS; "
            "print(len(SAFE_GLOBALS), [str(g) for g in SAFE_GLOBALS if g in torch.serialization.get_safe_globals()])")
    result = run([sys.executable, "-c", code], timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    listed, left = result.stdout.strip().splitlines()[-1].split(" ", 1)
    assert int(listed) > 5 and left == "[]", result.stdout


def test_te_extra_state_written_after_megatron_cores_import_loads_safely(tmp_path):
    """megatron.core 0.19's import puts its own function in place of torch.storage._load_from_bytes, which every
    CPU tensor pickled with pickle.dumps names (Transformer Engine's FP8 extra state is such a pickle): a
    checkpoint saved after it named megatron.core.safe_globals.safe_load_from_bytes and its resume was refused.
    After the megatron order's import, such an extra state names torch's function and passes the vetting. In a
    fresh interpreter: megatron imported once."""
    import sys

    from tests.launch import run

    code = ("import pickle, torch; from llmjp_ds.data import megatron_internals; megatron_internals.datasets(); "
            "from llmjp_ds.checkpoint.safe_load import vet_extra_state; "
            "extra = {'scale_fwd': torch.ones(3), 'amax_history_fwd': torch.zeros(1, 3), 'extra_fp8_variables': {}}; "
            "state = torch.frombuffer(bytearray(pickle.dumps(extra)), dtype=torch.uint8); "
            "vet_extra_state('ckpt.pt', 'layernorm_qkv._extra_state', state); "
            "print(torch.storage._load_from_bytes.__module__)")
    result = run([sys.executable, "-c", code], timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "torch.storage", result.stdout
