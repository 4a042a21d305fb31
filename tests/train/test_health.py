"""Training health: a planted spike (``LLMJP_DS_DRILL_SPIKE_STEPS``) detected at its step and answered by each
action, each checked against a reference run that never saw the spiked batch.

The references are the strongest we have: ``train.skip_steps`` (Megatron-LM's ``--iterations-to-skip``) reads a
step's samples without training on them and without advancing the LR schedule, which is what a skipped update and a
rollback's window must amount to. So a run whose update at step k was skipped must equal, step for step and in its
final weights, a run that skips step k; a run rolled back to checkpoint c over a spike at step k must equal a run
that skips steps c..k. In one process, in two (ZeRO-1 over two data-parallel ranks) and in a two-stage pipeline
(the skip's gate runs on the last stage and every rank must learn its answer).
"""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch

from llmjp_ds import checkpoint
from llmjp_ds.metrics.logger import read_metrics

from tests.launch import subprocess_env
from tests.runs import COMMON_SETS, LAYOUTS, cli, run_train, trail

SPIKE = 6  # the planted spike's step
SETS = ("train.steps=9", "optim.decay_steps=9", "checkpoint.interval=2", "checkpoint.keep_last=9",
        "health.min_history=3")
COMPARED = ("loss", "z_loss", "lr", "grad_norm", "consumed_samples")


def spiked(tmp, nproc: int, *sets: str, steps=(SPIKE,)):
    """A run with a spike planted (the loss and its gradients 20 times larger) at ``steps``."""
    import os

    env = subprocess_env(LLMJP_DS_DRILL_SPIKE_STEPS=",".join(map(str, steps)))
    saved = {k: os.environ.get(k) for k in env if k.startswith("LLMJP_DS_DRILL")}
    os.environ.update({k: v for k, v in env.items() if k.startswith("LLMJP_DS_DRILL")})
    try:
        return run_train(tmp, nproc, *sets)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def records(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in trail(run_dir)}


def weights(run_dir) -> dict[str, torch.Tensor]:
    tag = checkpoint.latest_tag(run_dir)
    return checkpoint.read_model_state(run_dir, tag, checkpoint.read_marker(run_dir, tag))


def assert_same(got, want, steps) -> None:
    a, b = records(got), records(want)
    for step in steps:
        for key in COMPARED:
            assert a[step][key] == b[step][key], f"step {step}: {key} {a[step][key]} != {b[step][key]}"
    wa, wb = weights(got), weights(want)
    assert sorted(wa) == sorted(wb) and all(torch.equal(wa[k], wb[k]) for k in wa), "final weights differ"


# --- detection and the monitor, pure ------------------------------------------------------------------------

def test_a_spike_is_measured_against_the_median_and_deviation_of_its_history():
    from llmjp_ds.config import SpikeRule
    from llmjp_ds.health.monitor import spike

    history = [4.0, 4.1, 3.9, 4.2, 3.8]  # median 4.0, MAD 0.1: sigma 0.14826
    rule = SpikeRule(threshold=6.0, min_ratio=1.1)
    assert spike(history, 4.8, rule, 3) is None  # z 5.4
    found = spike(history, 4.9, rule, 3)  # z 6.07, and 4.9 > 1.1 x 4.0
    assert found is not None and found.median == 4.0 and found.z == pytest.approx(0.9 / 0.14826)
    assert spike([4.0] * 5, 4.3, rule, 3) is None  # no deviation at all, but not 1.1 x the median
    assert spike(history[:2], 99.0, rule, 3) is None  # the warm-up: too little history for a verdict
    assert spike(history, math.nan, rule, 3) is None  # non-finite is a kind of its own


def test_drills_compose_and_hand_their_scales_to_the_step():
    """A planted spike over a planted NaN (both drills in one run): each step is handed both drills' scales, and
    the gate the step was given."""
    from types import SimpleNamespace

    from llmjp_ds.health.drills import NanDrill, SpikeDrill

    class Runner:
        seen: list = []

        def train_step(self, batches, gate=None, loss_scale=1.0, grad_scale=1.0):
            self.seen.append((loss_scale, grad_scale, gate))

    runner, precision = Runner(), SimpleNamespace(step=0)
    drilled = SpikeDrill(NanDrill(runner, precision, {2, 3}, any_phase=True), precision, {1, 3}, 20.0, "loss")
    for step in range(5):
        precision.step = step
        drilled.train_step([], gate=print)
    loss = [s for s, _, _ in runner.seen]
    assert loss[0] == 1.0 and loss[1] == 20.0 and math.isnan(loss[2]) and math.isnan(loss[3]) and loss[4] == 1.0
    assert all(gate is print for _, _, gate in runner.seen)
    grad = SpikeDrill(runner, precision, {4}, 7.0, "grad")
    precision.step = 4
    grad.train_step([])
    assert runner.seen[-1] == (1.0, 7.0, None)


def test_the_monitor_judges_each_kind_and_keeps_spikes_out_of_the_history():
    from llmjp_ds.config import HealthConfig, SpikeRule
    from llmjp_ds.data.batching import skip_window, skipped
    from llmjp_ds.health.monitor import HealthMonitor

    cfg = HealthConfig(min_history=3, loss=SpikeRule(action="skip"), grad_norm=SpikeRule(action="rollback"))
    h = HealthMonitor(cfg)
    for step, (loss, norm) in enumerate([(5.0, 1.0), (4.9, 1.1), (4.8, 0.9), (4.85, 1.0)]):
        assert h.after_step(step, loss, norm, True) is None and not h.gate(step, loss)
    assert h.gate_at(4)(50.0) and h.after_step(4, 50.0, 1.0, False, gated=True).action == "skip"
    assert HealthMonitor(HealthConfig(loss=SpikeRule(action="rollback"))).gate_at(4) is None  # the runner waits on none
    assert list(h.history["loss"]) == [5.0, 4.9, 4.8, 4.85]  # the spike stays out
    norm = h.after_step(5, 4.8, 30.0, True)
    assert (norm.kind, norm.action, norm.step) == ("grad_norm", "rollback", 5)
    assert h.after_step(6, math.nan, None, False).kind == "nonfinite"
    assert h.rollback_allowed(10) and h.rollback_allowed(11) and h.rollback_allowed(12)
    assert not h.rollback_allowed(13)  # max_rollbacks 3 within rollback_window 1000
    again = HealthMonitor(cfg)
    again.load_state_dict(h.state_dict())
    assert again.state_dict() == h.state_dict()
    # after a rollback to the checkpoint of step 4 over a spike at step 7: from step 5 (or the step before the
    # spike) through the spike (and two steps after it)
    assert skip_window(4, 7, None, 0) == [5, 7] and skip_window(4, 7, 1, 2) == [6, 9]
    assert skipped(5, [[5, 7]]) and skipped(7, [[5, 7]]) and not skipped(8, [[5, 7]]) and not skipped(4, [[5, 7]])


# --- runs: each action against its reference ----------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_planted_spike_is_detected_at_its_step(train_env, tmp_path):
    run_dir = spiked(tmp_path, 1, *SETS)
    events = [e for e in read_metrics(run_dir) if e.get("event") == "health"]
    assert [(e["step"], e["kind"], e["action"]) for e in events] == [(SPIKE, "loss", "warn")]
    recs = records(run_dir)
    assert events[0]["value"] == pytest.approx(recs[SPIKE]["loss"]) and recs[SPIKE]["loss"] > 100
    assert events[0]["median"] < 10


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", ["single", "zero1", "pp2"])
def test_a_skipped_update_equals_a_run_that_never_trained_on_that_batch(train_env, tmp_path, layout):
    nproc, sets = LAYOUTS[layout]
    run_dir = spiked(tmp_path / "spiked", nproc, *sets, *SETS, "health.loss.action=skip")
    reference = run_train(tmp_path / "reference", nproc, *sets, *SETS, f"train.skip_steps=[[{SPIKE}, {SPIKE}]]")
    assert [(e["step"], e["action"]) for e in read_metrics(run_dir) if e.get("event") == "health"] == [(SPIKE, "skip")]
    assert records(run_dir)[SPIKE]["skipped_steps"] == 1 and SPIKE not in records(reference)
    assert_same(run_dir, reference, [s for s in range(1, 10) if s != SPIKE])


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", ["single", "zero1"])
def test_a_rollback_equals_a_run_without_the_window_and_a_resume_keeps_the_window(train_env, tmp_path, layout):
    nproc, sets = LAYOUTS[layout]
    run_dir = spiked(tmp_path / "rolled", nproc, *sets, *SETS, "health.loss.action=rollback")
    (event,) = [e for e in read_metrics(run_dir) if e.get("event") == "rollback"]
    # the spike at step 6: back to the checkpoint before it (step 4; saves every 2 steps), steps 5 and 6 skipped
    assert (event["step"], event["to_step"], event["tag"], event["skipped_steps"]) == (6, 4, checkpoint.tag_for(4),
                                                                                      [5, 6])
    reference = run_train(tmp_path / "reference", nproc, *sets, *SETS, "train.skip_steps=[[5, 6]]")
    assert_same(run_dir, reference, range(7, 10))
    assert checkpoint.read_marker(run_dir, checkpoint.latest_tag(run_dir)).skip_steps == [[5, 6]]

    # stopped after the rollback, resumed: the window stays skipped, the trail is the uninterrupted one's
    spiked(tmp_path / "resumed", nproc, *sets, *SETS, "health.loss.action=rollback", "train.steps=7")
    resumed = run_train(tmp_path / "resumed", nproc, *sets, *SETS, "health.loss.action=rollback")
    assert_same(resumed, run_dir, range(7, 10))
    if layout != "single":
        return
    out = tmp_path / "trained.npy"
    cli(["samples", "--run", str(run_dir), "--start", "0", "--count", "72", "--output", str(out)], tmp_path / "samples")
    trained = np.load(out)
    every = tmp_path / "every.npy"
    cli(["samples", *[x for v in COMMON_SETS for x in ("--set", v)], "--start", "0", "--count", "72", "--output",
         str(every)], tmp_path / "every")  # the run's config, every sample
    assert np.array_equal(trained, np.delete(np.load(every), range(32, 48), axis=0))  # steps 5, 6: samples 32..47
    table = cli(["health", str(run_dir), "--plot"], tmp_path / "health").stdout
    assert "| 6 | loss spike | rollback:" in table and "steps 5..6 skipped" in table
    assert (run_dir / "health.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_too_many_rollbacks_stop_the_run_with_one_line(train_env, tmp_path):
    with pytest.raises(pytest.fail.Exception) as failed:
        spiked(tmp_path, 1, *SETS, "health.loss.action=rollback", "health.max_rollbacks=1", steps=(4, 8))
    lines = [line for line in str(failed.value).splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "one rollback more than health.max_rollbacks=1 within health.rollback_window=1000 " \
        "steps: the run stops rather than loop" in lines[0], lines
    assert "Traceback" not in str(failed.value)
    shutil.rmtree(tmp_path, ignore_errors=True)
