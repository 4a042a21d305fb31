"""Non-finite loss or gradients: the step is skipped (parameters and optimizer untouched), counted and logged;
``train.max_nonfinite_steps`` in a row stop the run with one clear line, after saving a checkpoint.

The fault drill ``LLMJP_DS_DRILL_NAN_STEPS=k`` with ``LLMJP_DS_DRILL_NAN_PHASE=any`` multiplies every
micro-batch's loss of step ``k`` (numbered from 1, as its record) by NaN, so the gradients are NaN too. ZeRO-0 in fp32 is the layout where
DeepSpeed steps the torch optimizer itself without any check (llmjp_ds.optim.adamw.SkipNonFiniteAdamW covers it); ZeRO-1 goes through
DeepSpeed's ZeRO optimizer, which skips on a non-finite gradient norm.
"""

from __future__ import annotations

import math

import pytest

from tests.reliability.conftest import (TINY, assert_latest_complete, events, read_records, run, subprocess_env,
                                        train_argv)

NAN_AT = 3  # the step whose loss is NaN, as its record numbers it


def drill(*steps: int) -> dict:
    return subprocess_env(LLMJP_DS_DRILL_NAN_STEPS=",".join(map(str, steps)), LLMJP_DS_DRILL_NAN_PHASE="any")


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_a_nonfinite_step_is_skipped_and_leaves_the_weights_alone(zero_stage, bundled, tmp_path):
    run_dir = tmp_path / "run"
    result = run(train_argv(run_dir, TINY, "train.steps=5", f"parallel.zero_stage={zero_stage}",
                            "checkpoint.interval=0", "train.eval_interval=1", "train.eval_batches=1"),
                 env=drill(NAN_AT))
    assert result.returncode == 0, result.stderr[-3000:]
    recs = {r["step"]: r for r in read_records(run_dir) if "event" not in r}
    skipped = events(run_dir, "skipped_step")
    assert [(e["step"], e["in_a_row"]) for e in skipped] == [(NAN_AT, 1)], skipped
    bad, before, after = recs[NAN_AT], recs[NAN_AT - 1], recs[NAN_AT + 1]
    assert math.isnan(bad["loss"]) and bad["skipped_steps"] == 1 and recs[5]["skipped_steps"] == 1
    # valid_loss is measured on the same fixed batch after each step's update: bit-identical across the skipped
    # step means no parameter moved; the step after it trains again, from finite weights
    assert bad["valid_loss"] == before["valid_loss"], (before, bad)
    assert math.isfinite(after["valid_loss"]) and after["valid_loss"] != bad["valid_loss"]
    assert all(math.isfinite(recs[s]["loss"]) for s in recs if s != NAN_AT)
    assert_latest_complete(run_dir)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_n_nonfinite_steps_in_a_row_stop_the_run_with_one_line(bundled, tmp_path):
    run_dir = tmp_path / "run"
    result = run(train_argv(run_dir, TINY, "train.steps=8", "checkpoint.interval=0", "train.max_nonfinite_steps=3"),
                 env=drill(2, 3, 4))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout
    last = result.stderr.strip().splitlines()[-1]
    assert last == ("error: 3 consecutive steps had non-finite loss or gradients (last: step 4); a checkpoint was "
                    "saved. Lower optim.lr or check the data, then resume"), result.stderr[-2000:]
    assert [e["in_a_row"] for e in events(run_dir, "skipped_step")] == [1, 2, 3]
    # the checkpoint it saved holds the state after step 4 (steps 2-4 skipped): complete and finite, and the LR
    # schedule's position in it counts the three skipped steps and their samples out (one update, 8 samples)
    assert assert_latest_complete(run_dir) == "step00000004"
    import torch

    state = torch.load(run_dir / "checkpoints" / "step00000004" / "mp_rank_00_model_states.pt", map_location="cpu",
                       weights_only=False)["train_state"]
    assert (state["skipped_total"], state["consumed_samples"], state["skipped_samples"]) == (3, 32, 24), state
