"""A ramped or changed global batch, and a blend that changes at a step, against megatron-core and Megatron-LM.

The batch of each step is megatron-core's own microbatch calculator's (``RampupBatchsizeNumMicroBatchesCalculator``
for ``--rampup-batch-size``, in megatron-core 0.16-0.18; ``StepBatchsizeNumMicroBatchesCalculator`` for
``--step-batch-size-schedule``, 0.19). The samples each rank reads are Megatron-LM's, written here from its code:
``MegatronPretrainingSampler`` hands out micro-batches of ``micro x dp`` samples in order from the consumed count,
``get_num_microbatches()`` of them an iteration; a run restarted with another ``--data-path`` builds the new blend
for ``train_iters * gbs`` samples and reads on from its consumed count; under ``--phase-transition-iterations`` the
new phase's blend is built for the phase's samples and read from its first. Ours come through what the trainer
calls: ``RunData.train_at(step)`` / ``valid_at(step)``, ``BatchSchedule.batch`` and ``batching.step_micro_batches``.
"""

from __future__ import annotations

import importlib
import warnings

import numpy as np
import pytest

from tests.data.test_megatron_order import (BLENDS, DP, EVAL_INTERVAL, EVAL_ITERS, MBS, SEQ, SPLIT, STEPS,  # noqa: F401
                                            corpora, megatron, megatron_lm_datasets, public_window, run_config)

GBS = 8
RAMPS = [(2, 2, 20), (2, 2, 37), (4, 4, 8), (2, 6, 30)]


def calculator(name: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = importlib.import_module("megatron.core.num_microbatches_calculator")
    if not hasattr(module, name):
        pytest.skip(f"megatron-core {module.__name__} has no {name} in this version")
    return getattr(module, name)


@pytest.mark.parametrize("ramp", RAMPS)
def test_a_ramp_is_megatron_cores_rampup_calculator(ramp):
    from llmjp_ds.data.batch_schedule import BatchSchedule

    start, increment, samples = ramp
    gbs = start + increment * 3
    theirs = calculator("RampupBatchsizeNumMicroBatchesCalculator")(gbs, 1, 2, False, 0, start, increment, samples)
    ours = BatchSchedule(gbs, ramp)
    consumed = 0
    for step in range(60):
        theirs.update(consumed, consistency_check=True)
        batch = theirs.get_current_global_batch_size()
        assert ours.batch(step, consumed) == batch, f"step {step} at {consumed} samples"
        assert ours.consumed_at(step) == consumed and ours.step_at(consumed) == step
        assert all(ours.step_of_sample(i) == step for i in range(consumed, consumed + batch))
        consumed += batch
    pieces = ours.pieces(60)
    assert pieces[0] == (0, start) and pieces[-1][1] == gbs
    assert [ours.batch(s, ours.consumed_at(s)) for s in range(60)] == [
        next(b for first, b in reversed(pieces) if first <= s) for s in range(60)]


def test_step_changes_are_megatron_cores_step_schedule():
    """Megatron-Core 0.19's ``--step-batch-size-schedule`` with its thresholds at the samples consumed before each
    change's step (given in samples: no sequence length to convert tokens)."""
    from llmjp_ds.data.batch_schedule import BatchSchedule

    ours = BatchSchedule(4, None, ((3, 8), (7, 2), (9, 16)))
    thresholds = " ".join(f"{ours.consumed_at(s)}:{b}" for s, b in ((0, 4), *ours.changes))
    theirs = calculator("StepBatchsizeNumMicroBatchesCalculator")(1, 2, False, 0, thresholds, None)
    consumed = 0
    for step in range(20):
        theirs.update(consumed, consistency_check=True)
        assert ours.batch(step, consumed) == theirs.get_current_global_batch_size(), f"step {step}"
        consumed += ours.batch(step, consumed)


def batches_megatron_lm_reads(train, batch_of: list[int], rank: int, first: int = 0):
    """Rank ``rank``'s micro-batches of each step, as Megatron-LM's sampler deals them from sample ``first`` on
    (``get_num_microbatches()`` an iteration): the sampler knows no steps, only micro-batches of ``MBS x DP``."""
    flat = iter(range(first, len(train)))
    out = []
    for batch in batch_of:
        for _ in range(batch // (MBS * DP)):
            ids = [next(flat) for _ in range(MBS * DP)]
            out.append(np.stack([public_window(train, i) for i in ids[rank * MBS:(rank + 1) * MBS]]))
    return out


def our_step_reads(data, batches, steps, rank: int) -> list[np.ndarray]:
    from llmjp_ds.data import batching

    out = []
    for step in steps:
        consumed = batches.consumed_at(step)
        batch = batches.batch(step, consumed)
        micro = batching.step_micro_batches(data.train_at(step), consumed, batch // (MBS * DP), MBS, rank, DP)
        out += [np.concatenate([x.numpy(), y.numpy()[:, -1:]], axis=1) for x, y in micro]
    return out


def run_data(cfg):
    from llmjp_ds.config import model_config_of, seq_len_of
    from llmjp_ds.trainer import run_data

    model_config = model_config_of(cfg)
    return run_data(cfg, model_config, seq_len_of(cfg, model_config))


def test_a_ramped_run_reads_megatron_lms_samples(megatron, corpora, tmp_path):
    """--rampup-batch-size 4 4 40 to a global batch of 8 (sample-based: --train-samples = what the steps read)."""
    blend = BLENDS["weighted"](corpora)
    cfg = run_config(blend, tmp_path / "ours", f"train.global_batch_size={GBS}", "train.batch_rampup=[4, 4, 40]",
                     "train.eval_interval=0")
    data = run_data(cfg)
    batches = data.batches
    total = batches.consumed_at(STEPS)
    assert total == 4 * 10 + 8 * 2  # 4 until 40 samples are consumed (Megatron: at 40, int(40 / 40) = 1), then 8
    train, _ = megatron_lm_datasets_of_size(megatron, blend, tmp_path / "megatron", total)
    batch_of = [batches.batch(s, batches.consumed_at(s)) for s in range(STEPS)]
    for rank in range(DP):
        ours = our_step_reads(data, batches, range(STEPS), rank)
        theirs = batches_megatron_lm_reads(train, batch_of, rank)
        assert len(ours) == len(theirs) == sum(b // (MBS * DP) for b in batch_of)
        assert all(np.array_equal(a, b) for a, b in zip(ours, theirs)), f"rank {rank}"


def megatron_lm_datasets_of_size(megatron, blend, cache, train_samples: int):
    """Megatron-LM's (train, valid) with a train split of ``train_samples`` (``--train-samples``, or a phase's)."""
    return megatron_lm_datasets(megatron, blend, ",".join(map(str, SPLIT)), cache, train_samples)


@pytest.mark.parametrize("count", ["run", "phase"])
def test_a_blend_change_reads_megatron_lms_samples(megatron, corpora, tmp_path, count):
    """The blend changes at step 6 (blend A, then B): from then on the samples are those of Megatron-LM restarted
    after iteration 5 with B's --data-path (``run``: B built for all STEPS x GBS samples, read from 5 x GBS;
    ``phase``: B built for the phase's (STEPS - 5) x GBS, read from its first), and the validation after the change
    reads B's valid split at the same valid count."""
    a, b = BLENDS["weighted"](corpora), ["10", corpora[2], "90", corpora[0]]
    phases = f"[{{start_step: 6, count: {count}, blend: [{', '.join(b)}]}}]"
    cfg = run_config(a, tmp_path / "ours", f"train.global_batch_size={GBS}", f"data.phases={phases}")
    data = run_data(cfg)
    ref_a, valid_a = megatron_lm_datasets_of_size(megatron, a, tmp_path / "meg-a", STEPS * GBS)
    b_size = STEPS * GBS if count == "run" else (STEPS - 5) * GBS
    ref_b, valid_b = megatron_lm_datasets_of_size(megatron, b, tmp_path / "meg-b", b_size)
    batch_of = [GBS] * STEPS
    for rank in range(DP):
        before = batches_megatron_lm_reads(ref_a, batch_of[:5], rank)
        after = batches_megatron_lm_reads(ref_b, batch_of[5:], rank, first=5 * GBS if count == "run" else 0)
        ours = our_step_reads(data, data.batches, range(STEPS), rank)
        assert all(np.array_equal(x, y) for x, y in zip(ours, before + after)), f"rank {rank}"
        assert not np.array_equal(ours[len(before)], batches_megatron_lm_reads(ref_a, batch_of[5:6], rank,
                                                                                first=5 * GBS)[0])
    # the valid splits: A's before the change, B's after it (each Megatron's for the run's valid size)
    for step, theirs in ((4, valid_a), (5, valid_b)):
        assert all(np.array_equal(data.valid_at(step)[i], public_window(theirs, i)) for i in range(16))
    assert not np.array_equal(data.valid_at(5)[0], public_window(valid_a, 0))


def test_the_samples_verb_follows_the_phases(megatron, corpora, tmp_path):
    from llmjp_ds.samples import cli_main

    a, b = BLENDS["weighted"](corpora), ["10", corpora[2], "90", corpora[0]]
    sets = ["data.order=megatron", f"data.blend=[{', '.join(a)}]", f"data.seq_len={SEQ}", f"data.split={SPLIT}",
            f"data.cache_dir={tmp_path / 'ours'}", f"train.steps={STEPS}", f"train.global_batch_size={GBS}",
            f"data.phases=[{{start_step: 6, blend: [{', '.join(b)}]}}]", f"run_dir={tmp_path / 'run'}"]
    out = tmp_path / "w.npy"
    assert cli_main([x for s in sets for x in ("--set", s)] + ["--start", "36", "--count", "8", "--output",
                                                               str(out)]) == 0
    ref_a, _ = megatron_lm_datasets_of_size(megatron, a, tmp_path / "meg-a", STEPS * GBS)
    ref_b, _ = megatron_lm_datasets_of_size(megatron, b, tmp_path / "meg-b", STEPS * GBS)
    want = [public_window(ref_a, i) for i in range(36, 40)] + [public_window(ref_b, i) for i in range(40, 44)]
    assert np.array_equal(np.load(out), np.stack(want))  # samples 36-39 are step 5's, 40-43 step 6's
