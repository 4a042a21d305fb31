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
from llmjp_ds.metrics.record import current_steps, read_metrics

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


def events_of(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "event" in r]


def health_report(run_dir, tmp) -> tuple[list[str], str]:
    """``llmjp-ds health RUN_DIR``: its table's rows (step, what, detail) and its last line (the counts)."""
    out = cli(["health", str(run_dir)], tmp / "health").stdout.strip().splitlines()
    rows = [tuple(cell.strip() for cell in line.strip("|").split("|")) for line in out[2:] if line.startswith("| ")]
    return rows, out[-1]


def stopped(tmp, *sets, steps) -> str:
    """A spiked run that ends with one line: the line."""
    with pytest.raises(pytest.fail.Exception) as failed:
        spiked(tmp, 1, *sets, steps=steps)
    lines = [line for line in str(failed.value).splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in str(failed.value), str(failed.value)[-3000:]
    return lines[0]


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


def test_a_router_collapse_is_judged_after_starved_steps_in_a_row_and_survives_a_resume():
    """health.router.starved_steps=3: an expert without a token in steps 1..3 is a verdict at step 3, naming it;
    one that gets a token in between starts counting again; another expert's starved steps are not its; after a
    verdict the next one on it comes as many steps later; and the count goes on across a checkpoint's state (a
    resume), as it would not from a fresh monitor."""
    import json

    from llmjp_ds.config import HealthConfig
    from llmjp_ds.config.schema import RouterRule
    from llmjp_ds.health.monitor import HealthMonitor

    cfg = HealthConfig(router=RouterRule(action="stop", starved_steps=3))
    h = HealthMonitor(cfg)
    assert h.after_routing(1, [(0, 2)]) is None and h.after_routing(2, [(0, 2), (1, 5)]) is None
    found = h.after_routing(3, [(0, 2)])  # expert 5 of layer 1 got a token at step 3
    assert (found.kind, found.action, found.step, found.value, found.where) == ("router", "stop", 3, 3.0,
                                                                                "expert 2 of MoE layer 0")
    assert found.describe() == "a router collapse at step 3: expert 2 of MoE layer 0 got no token for 3 steps"
    assert found.fields() == {"kind": "router", "action": "stop", "value": 3.0, "where": "expert 2 of MoE layer 0"}
    assert h.after_routing(4, [(0, 2)]) is None and h.after_routing(5, [(0, 2)]) is None
    assert h.after_routing(6, [(0, 2)]).step == 6  # the next verdict on it: starved_steps later

    h = HealthMonitor(cfg)
    steps = [[(0, 2)], [(0, 2)], [], [(0, 2)], [(0, 2)], [(1, 0)], [(1, 0)]]  # step 3: expert 2 got a token
    assert [h.after_routing(step, starved) for step, starved in enumerate(steps, 1)] == [None] * 7
    assert h.after_routing(8, [(1, 0), (0, 2)]).where == "expert 0 of MoE layer 1"

    h = HealthMonitor(cfg)
    h.after_routing(1, [(1, 3)])
    h.after_routing(2, [(1, 3)])
    state = json.loads(json.dumps(h.state_dict()))  # as a checkpoint keeps it
    assert state["starved"] == {"1:3": 2}
    resumed = HealthMonitor(cfg)
    resumed.load_state_dict(state)
    assert resumed.after_routing(3, [(1, 3)]).where == "expert 3 of MoE layer 1"
    assert HealthMonitor(cfg).after_routing(3, [(1, 3)]) is None  # without the state: a streak of one
    older = HealthMonitor(cfg)
    older.load_state_dict({k: v for k, v in state.items() if k != "starved"})  # a checkpoint from before routing
    assert older.starved == {} and older.after_routing(3, [(1, 3)]) is None


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
    # recorded as a skip, with the loss that caused it: no gradient norm (no update was made), no overflow notice
    spike = records(run_dir)[SPIKE]
    assert spike["skipped"] == "loss spike" and "grad_norm" not in spike and spike["loss"] > 100
    logs = "".join(p.read_text() for p in (tmp_path / "spiked").glob("train-*.*"))
    assert "OVERFLOW" not in logs and f"a loss spike at step {SPIKE}" in logs and "update skipped (loss spike)" in logs
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

    # stopped after the rollback with no save since the one the rollback made (step 4's), resumed from that one:
    # the window stays skipped, the trail is the uninterrupted one's, and the record keeps the spike and the rollback
    # logged at step 6, after the step the resume went back to
    spiked(tmp_path / "resumed", nproc, *sets, *SETS, "health.loss.action=rollback", "train.steps=7",
           "checkpoint.save_at_end=false")
    before = events_of(tmp_path / "resumed" / "run")
    resumed = run_train(tmp_path / "resumed", nproc, *sets, *SETS, "health.loss.action=rollback")
    assert_same(resumed, run_dir, range(7, 10))
    after = events_of(resumed)
    assert after[:len(before)] == before and [e["event"] for e in before if e["event"] in ("health", "rollback")] == [
        "health", "rollback"]
    assert [(e["step"], e["tag"]) for e in after if e["event"] == "resume"] == [(4, checkpoint.tag_for(4, 1))]
    assert list(current_steps(read_metrics(resumed))) == [1, 2, 3, 4, 7, 8, 9]  # step 5 was gone back over
    rows, counts = health_report(resumed, tmp_path)
    assert [(r[0], r[1]) for r in rows] == [("6", "loss spike"), ("6", "rollback"), ("4", "resume")], rows
    assert counts.startswith("7 steps logged, 1 rollbacks, 2 updates skipped;") and \
        counts.endswith("not trained on: 5..6 (rollback at step 6)"), counts
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
def test_too_many_rollbacks_stop_the_run_with_one_line_and_the_record_says_so(train_env, tmp_path):
    """Spikes at steps 4 and 8 with health.max_rollbacks=1: the first is rolled back (to step 2, steps 3..4 skipped),
    the second would be one rollback more: a stop. Resumed as the line says, the report lists both spikes, the one
    rollback and its window, and that the run stopped; its counts agree with its rows."""
    sets = (*SETS, "health.loss.action=rollback", "health.max_rollbacks=1")
    line = stopped(tmp_path, *sets, steps=(4, 8))
    assert "one rollback more than health.max_rollbacks=1 within health.rollback_window=1000 steps: the run stops " \
        "rather than loop" in line, line
    run_dir = tmp_path / "run"
    before = events_of(run_dir)
    (stop,) = [e for e in before if e["event"] == "stop"]
    assert stop["step"] == 8 and stop["reason"] == line.removeprefix("error: ")
    assert stop["latest"] == checkpoint.tag_for(6, 1) == checkpoint.latest_tag(run_dir)
    run_train(tmp_path, 1, *sets)  # resumed, the drill gone
    assert events_of(run_dir)[:len(before)] == before
    rows, counts = health_report(run_dir, tmp_path)
    rows = [r for r in rows if r[1] != "grad_norm spike"]  # step 7's gradient norm after the skip, warned (twice)
    assert [(r[0], r[1]) for r in rows] == [("4", "loss spike"), ("4", "rollback"), ("8", "loss spike"),
                                            ("8", "the run stopped"), ("6", "resume")], rows
    assert rows[0][2].startswith("rollback: ") and rows[2][2].startswith("stop (health.max_rollbacks reached): ")
    assert rows[4][2] == f"tag {checkpoint.tag_for(6, 1)}"
    assert counts.startswith("7 steps logged, 1 rollbacks, 1 stops, ") and \
        counts.endswith("not trained on: 3..4 (rollback at step 4)"), counts
    assert list(current_steps(read_metrics(run_dir))) == [1, 2, 5, 6, 7, 8, 9]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_stop_verdict_is_a_row_of_the_report_after_a_resume(train_env, tmp_path):
    """health.loss.action=stop: the spike at step 6 ends the run (one line, step 4's checkpoint the latest); resumed
    without the spike, the run ends, and the record still holds the verdict and the stop, written before the resume
    went back to step 4."""
    line = stopped(tmp_path, *SETS, "health.loss.action=stop", steps=(SPIKE,))
    assert line.startswith(f"error: a loss spike at step {SPIKE}: ") and \
        f"health.loss.action is stop: the run ends here, and {checkpoint.tag_for(4)} is its latest checkpoint" in line
    run_dir = tmp_path / "run"
    before = events_of(run_dir)
    run_train(tmp_path, 1, *SETS, "health.loss.action=stop")
    assert events_of(run_dir)[:len(before)] == before
    rows, counts = health_report(run_dir, tmp_path)
    assert [(r[0], r[1]) for r in rows] == [(str(SPIKE), "loss spike"), (str(SPIKE), "the run stopped"),
                                            ("4", "resume")], rows
    assert rows[0][2].startswith("stop: value ")
    assert rows[1][2].endswith(f"(latest checkpoint: {checkpoint.tag_for(4)})")
    assert counts.startswith("9 steps logged, 0 rollbacks, 1 stops, 0 updates skipped;") and counts.endswith("none")
    shutil.rmtree(tmp_path, ignore_errors=True)
