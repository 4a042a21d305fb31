"""Throughput/MFU arithmetic, the metrics.jsonl trail, and real offline wandb runs read back from their .wandb log."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llmjp_ds.errors import UserError
from llmjp_ds.metrics.logger import (
    MetricsLogger, Throughput, format_log_line, peak_flops_for_device, peak_memory_gib, peak_tflops,
)
from llmjp_ds.metrics.record import current_steps, read_metrics, trail

from tests import disk


# --- throughput and MFU ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, dtype, expected", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.0),
    ("NVIDIA H200", "bf16", 989.0),
    ("NVIDIA H100 80GB HBM3", "fp8", 1979.0),
    ("NVIDIA H100 PCIe", "bf16", 756.0),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
    ("NVIDIA A100-SXM4-80GB", "fp8", None),
    ("NVIDIA GeForce RTX 3090", "bf16", None),
])
def test_peak_tflops_table(name, dtype, expected):
    assert peak_tflops(name, dtype) == expected


def test_peak_flops_for_device():
    assert peak_flops_for_device(device_name="NVIDIA H200") == 989e12
    assert peak_flops_for_device(device_name="Some CPU") is None


def test_throughput_reference_numbers():
    # The 172B exp1 step: 1728 x 4096 tokens on 512 GPUs, 1.05602088960e12 training FLOPs per token.
    # At the blog's ~400 TFLOP/s per GPU a step takes 1.0560208896e12 * 7,077,888 / (512 * 400e12) = 36.50 s.
    tput = Throughput(1_056_020_889_600, 1728 * 4096, world_size=512, peak_flops=989e12)
    out = tput.update(36.5)
    assert out["tokens_per_s"] == pytest.approx(7_077_888 / 36.5)
    assert out["tflops_per_gpu"] == pytest.approx(1_056_020_889_600 * 7_077_888 / 36.5 / 512 / 1e12)
    assert out["tflops_per_gpu"] == pytest.approx(400.0, abs=0.05)
    assert out["mfu"] == pytest.approx(400.0 / 989.0, abs=1e-4)
    # Twice as fast: twice the TFLOP/s.
    assert tput.update(18.25)["tflops_per_gpu"] == pytest.approx(2 * out["tflops_per_gpu"])


def test_throughput_without_peak_omits_mfu():
    out = Throughput(6e9, 8192, world_size=2, peak_flops=None).update(2.0)
    assert out == {"tokens_per_s": 4096.0, "tflops_per_gpu": 6e9 * 4096 / 2 / 1e12}


def test_peak_memory_is_positive_on_cpu():
    assert 0.001 < peak_memory_gib() < 1024


# --- the human log line ------------------------------------------------------------------------------------------

def test_format_log_line():
    line = format_log_line(120, 1000, {
        "loss": 3.45214, "z_loss": 1.234e-4, "lr": 2.5e-4, "grad_norm": 0.8701, "tokens_per_s": 12345.0,
        "tflops_per_gpu": 401.23, "mfu": 0.40569, "peak_memory_gib": 45.31, "phase": "fp8"})
    assert line == ("step  120/1000 | loss 3.4521 z 1.23e-04 | lr 2.50e-04 | gnorm 0.870 | 12.3k tok/s | "
                    "401.2 TFLOP/s | MFU 40.6% | mem 45.3 GiB | fp8")
    assert format_log_line(7, None, {"loss": float("nan")}) == "step 7 | loss nan"
    # a step whose update the health gate skipped: its loss, and no gradient norm (there was no update to measure)
    assert format_log_line(6, 9, {"loss": 212.5, "skipped": "loss spike", "lr": 1e-3}) == \
        "step 6/9 | loss 212.5000 | update skipped (loss spike) | lr 1.00e-03"


def test_an_moe_runs_log_line_shows_its_load_balancing_loss():
    """An MoE step's record holds its routing (metrics/experts.py); the line shows the load-balancing loss after the
    losses and nothing else of it (the matrix and per-layer lists are the record's). A dense step's line has none."""
    dense = {"loss": 3.45214, "z_loss": 1.234e-4, "lr": 2.5e-4, "grad_norm": 0.8701}
    moe = {**dense, "moe_aux_loss": 1.02449, "moe_z_loss": 3.5, "moe_imbalance": 1.7, "moe_dropped_tokens": 0,
           "moe_layer_imbalance": [1.7, 1.2], "moe_min_load": [3, 9], "moe_expert_load": [[3, 20], [9, 14]]}
    assert format_log_line(120, 1000, moe) == \
        "step  120/1000 | loss 3.4521 z 1.23e-04 aux 1.024 | lr 2.50e-04 | gnorm 0.870"
    assert format_log_line(120, 1000, dense) == "step  120/1000 | loss 3.4521 z 1.23e-04 | lr 2.50e-04 | gnorm 0.870"
    assert format_log_line(3, None, {"loss": 2.0, "moe_aux_loss": 1.5}) == "step 3 | loss 2.0000 aux 1.500"


# --- the jsonl trail, wandb disabled -----------------------------------------------------------------------------

def test_disabled_logger_writes_jsonl_and_reads_back(tmp_path):
    with MetricsLogger(tmp_path, wandb_mode="disabled") as logger:
        assert len(logger.run_id) == 8 and logger.run_id.isalnum()
        logger.log(1, {"loss": 10.5, "lr": 1e-4, "phase": "bf16"})
        logger.log(2, {"loss": float("nan"), "lr": 2e-4, "phase": "fp8"})
        logger.event(2, "rollback", to_step=1, reason="nan loss")
        # flushed per line: readable while the logger is open
        assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 2]
    records = read_metrics(tmp_path)
    assert [{k: v for k, v in r.items() if k != "time"} for r in records[:1]] == [
        {"step": 1, "loss": 10.5, "lr": 1e-4, "phase": "bf16", "attempt": 1}]
    assert math.isnan(records[1]["loss"])
    assert {k: v for k, v in records[2].items() if k != "time"} == {
        "step": 2, "event": "rollback", "to_step": 1, "reason": "nan loss", "attempt": 1}
    assert not (tmp_path / "wandb").exists()


def test_logger_accepts_tensor_and_numpy_scalars(tmp_path):
    import numpy as np
    import torch

    with MetricsLogger(tmp_path, wandb_mode="disabled") as logger:
        logger.log(1, {"loss": torch.tensor(2.5), "grad_norm": np.float32(0.5), "tokens": np.int64(4096)})
    assert read_metrics(tmp_path)[0] | {"time": 0} == {"step": 1, "time": 0, "loss": 2.5, "grad_norm": 0.5,
                                                       "tokens": 4096, "attempt": 1}


def test_a_resume_appends_and_marks_the_steps_it_goes_back_over(tmp_path):
    """A killed run logged past its checkpoint (steps 6..10, an event at step 7, a torn line); the resume from step
    5 appends: every byte written before stays, the event too, and each step's current record is the resume's."""
    with MetricsLogger(tmp_path, wandb_mode="disabled") as first:
        for step in range(1, 11):
            first.log(step, {"loss": 10.0 - step})
        first.event(7, "rollback", to_step=5)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 11, "loss": 0.')  # torn by the kill
    before = (tmp_path / "metrics.jsonl").read_bytes()

    # Resume from the checkpoint at step 5 with the run id stored in it.
    with MetricsLogger(tmp_path, wandb_mode="disabled", run_id=first.run_id, step=5) as resumed:
        assert resumed.run_id == first.run_id and resumed.attempt == 2
        for step in range(6, 9):
            resumed.log(step, {"loss": 100.0 + step})
    assert (tmp_path / "metrics.jsonl").read_bytes().startswith(before + b"\n")  # nothing rewritten
    records = read_metrics(tmp_path)
    assert [(r["step"], r.get("event"), r["attempt"]) for r in records if "event" in r] == [
        (7, "rollback", 1), (5, "attempt", 2)]
    assert len([r for r in records if "event" not in r]) == 13  # steps 6..8 twice, each marked by its attempt
    assert {s: r["loss"] for s, r in current_steps(records).items()} == {
        1: 9.0, 2: 8.0, 3: 7.0, 4: 6.0, 5: 5.0, 6: 106.0, 7: 107.0, 8: 108.0}  # not 9, 10: gone back over
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temp file left behind


def test_a_rollback_is_an_attempt_too(tmp_path):
    """A rollback inside one process: back to step 4 after logging 1..6; steps 5 and 6 skipped afterwards (read, not
    trained on, not logged): their records of the abandoned timeline are no step's current record any more."""
    with MetricsLogger(tmp_path, wandb_mode="disabled") as logger:
        for step in range(1, 7):
            logger.log(step, {"loss": float(step)})
        logger.new_attempt(4, "rollback")
        logger.event(6, "rollback", to_step=4, skipped_steps=[5, 6])
        for step in (7, 8):
            logger.log(step, {"loss": 70.0 + step})
    assert [(r["step"], r["loss"]) for r in trail(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0),
                                                                (7, 77.0), (8, 78.0)]
    # resumed later from the checkpoint of step 7: step 8 again, attempt 3; attempt 2's step 7 stays current
    with MetricsLogger(tmp_path, wandb_mode="disabled", step=7) as resumed:
        assert resumed.attempt == 3
        resumed.log(8, {"loss": 88.0})
    assert [r["loss"] for r in trail(tmp_path)][-2:] == [77.0, 88.0]
    assert [r["event"] for r in read_metrics(tmp_path) if "event" in r] == ["attempt", "rollback", "attempt"]


def test_a_garbled_line_does_not_stop_a_resume(tmp_path):
    """Bytes that are not UTF-8 (a disk error, a hand edit) in metrics.jsonl: the resume and read_metrics skip that
    line, as plot does, where opening the file as text raised UnicodeDecodeError; the line stays where it was."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 2.0}\n\xff\xfe garbled\n{"step": 2, "loss": 1.5}\n{"step": 3, "loss": 1.0}\n')
    with MetricsLogger(tmp_path, wandb_mode="disabled", step=2) as resumed:
        assert resumed.attempt == 2  # records without an attempt were the first
        resumed.log(3, {"loss": 0.5})
    assert [(s, r["loss"]) for s, r in current_steps(read_metrics(tmp_path)).items()] == [(1, 2.0), (2, 1.5), (3, 0.5)]
    assert b"\xff" in path.read_bytes()


def test_a_full_disk_leaves_no_part_of_a_line_and_stops_the_logger(tmp_path):
    """On a tmpfs filled up to a few bytes: the write that does not fit leaves nothing of its line, says which file
    and what is free, and the logger writes no more; what was written before is intact."""
    with disk.tmpfs(tmp_path / "small", "1m") as small:
        with MetricsLogger(small, wandb_mode="disabled") as logger:
            logger.log(1, {"loss": 2.0})
            before = (small / "metrics.jsonl").read_bytes()
            disk.fill(small, leave=0)
            logger.log(2, {"loss": 1.5, "note": "x" * 5000})  # beyond the page the first line started
            assert logger.failure and logger.failure.startswith(f"writing {small / 'metrics.jsonl'} failed (No space "
                                                                "left on device (ENOSPC); ")
            assert logger.failure.endswith(" free there)") and not logger.active
            logger.event(2, "health")  # no more writes, no more errors
        assert (small / "metrics.jsonl").read_bytes() == before


def test_the_guard_is_asked_before_every_write(tmp_path):
    """A run directory that is no longer the one locked: the guard's one line, and nothing written."""
    def guard():
        if (tmp_path / "moved").exists():
            raise UserError("run_dir is no longer the directory this run locked")

    with MetricsLogger(tmp_path, wandb_mode="disabled", guard=guard) as logger:
        logger.log(1, {"loss": 2.0})
        (tmp_path / "moved").touch()
        with pytest.raises(UserError, match="no longer the directory"):
            logger.log(2, {"loss": 1.0})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]


def test_append_after_a_torn_line_starts_a_new_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    with MetricsLogger(tmp_path, wandb_mode="disabled") as logger:  # a start afresh (no checkpoint): from step 0
        logger.log(3, {"loss": 1.0})
    assert [(r["step"], r.get("loss")) for r in read_metrics(tmp_path)] == [(1, 2.0), (0, None), (3, 1.0)]
    assert list(current_steps(read_metrics(tmp_path))) == [3]  # the first start's step 1 was gone back over


def test_other_ranks_write_nothing(tmp_path):
    logger = MetricsLogger(tmp_path / "run", wandb_mode="offline", rank=1, run_id="abc")
    logger.log(1, {"loss": 1.0})
    logger.event(1, "rollback")
    logger.close()
    assert logger.run_id == "abc" and not logger.active
    assert not (tmp_path / "run").exists()


def test_bad_wandb_mode_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="online, offline, disabled"):
        MetricsLogger(tmp_path, wandb_mode="ofline")


def test_read_metrics_of_a_missing_run_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no metrics.jsonl"):
        read_metrics(tmp_path / "nope")


def test_disabled_mode_never_imports_wandb(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        from llmjp_ds.metrics.logger import MetricsLogger, Throughput, format_log_line, peak_memory_gib
        with MetricsLogger({str(tmp_path)!r}, wandb_mode="disabled", step=3) as logger:
            logger.log(1, {{"loss": 1.0, **Throughput(1e9, 100, peak_flops=None).update(1.0)}})
            logger.event(1, "rollback")
            format_log_line(1, 2, {{"loss": 1.0}}); peak_memory_gib()
        print(sorted(m for m in sys.modules if m.split(".")[0] == "wandb"))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- real offline wandb runs -------------------------------------------------------------------------------------

def _wandb_records(run_dir: Path, run_id: str) -> list[list[dict]]:
    """The records of every offline run of ``run_id`` under ``<run_dir>/wandb``, oldest first, read with wandb's
    own reader (`wandb leet inspect --json`)."""
    runs = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    out = []
    for run in runs:
        log = run / f"run-{run_id}.wandb"
        text = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                              capture_output=True, text=True, check=True, timeout=60).stdout
        out.append([json.loads(line) for line in text.splitlines() if line.strip()])
    return out


def _history(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r["history"]["item"].items() if not k.startswith("_")}
            for r in records if r["type"] == "history"]


def test_offline_wandb_run_logs_and_resumes_the_same_run(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_DIR", raising=False)  # the logger sets it; put it back afterwards
    config = {"model": {"preset": "tiny", "hidden_size": 64}, "lr": 3e-4}
    with MetricsLogger(tmp_path, wandb_mode="offline", project="llmjp-ds-test", run_name="t",
                       config=config) as logger:
        run_id = logger.run_id
        for step in (1, 2, 3):
            logger.log(step, {"loss": 4.0 / step, "lr": 1e-4 * step, "phase": "bf16"})
        logger.event(3, "precision_flip", to="fp8")

    (first,) = _wandb_records(tmp_path, run_id)
    run_record = next(r["run"] for r in first if r["type"] == "run")
    assert run_record["run_id"] == run_id and run_record["project"] == "llmjp-ds-test"
    assert {k: v for k, v in run_record["config"]["update"].items() if k != "_wandb"} == config
    assert _history(first) == [
        {"step": 1, "loss": 4.0, "lr": 1e-4, "phase": "bf16"},
        {"step": 2, "loss": 2.0, "lr": 2e-4, "phase": "bf16"},
        {"step": 3, "loss": 4.0 / 3, "lr": pytest.approx(3e-4), "phase": "bf16"},
        {"step": 3, "event/precision_flip": 1},
    ]
    metric = [r["metric"] for r in first if r["type"] == "metric"]
    assert {"glob_name": "*", "options": {"defined": True, "step_sync": True}, "step_metric": "step"} in metric

    # A killed run resumed from its step-2 checkpoint: the same wandb run id, replayed steps kept (they are
    # plotted against the `step` metric, so wandb's monotonic _step does not drop them).
    with MetricsLogger(tmp_path, wandb_mode="offline", project="llmjp-ds-test", run_id=run_id,
                       step=2) as resumed:
        assert resumed.run_id == run_id
        resumed.log(3, {"loss": 1.5, "lr": 3e-4, "phase": "fp8"})

    first_again, second = _wandb_records(tmp_path, run_id)
    assert first_again == first
    run_record = next(r["run"] for r in second if r["type"] == "run")
    assert run_record["run_id"] == run_id and run_record["resume"] is True
    assert _history(second) == [{"step": 3, "loss": 1.5, "lr": 3e-4, "phase": "fp8"}]
    assert [(s, r["loss"]) for s, r in current_steps(read_metrics(tmp_path)).items()] == [(1, 4.0), (2, 2.0),
                                                                                        (3, 1.5)]


def test_batch_and_data_phase_changes_are_events_of_their_own():
    """A run's current step records give one ``batch_change`` where the global batch changes and one
    ``data_phase`` where the data phase does, each with the value before it; a run without either gives none."""
    from llmjp_ds.metrics.record import changes

    steps = {1: {"global_batch_size": 4}, 2: {"global_batch_size": 4, "data_phase": 0},
             3: {"global_batch_size": 8, "data_phase": 0}, 4: {"global_batch_size": 8, "data_phase": 1},
             5: {"global_batch_size": 8, "data_phase": 1}}
    assert changes(steps) == [{"step": 3, "event": "batch_change", "global_batch_size": 8, "from": 4},
                              {"step": 4, "event": "data_phase", "data_phase": 1, "from": 0}]
    assert changes({s: {"global_batch_size": 8} for s in range(1, 5)}) == []


def test_the_health_report_lists_phase_and_batch_changes_among_the_events(tmp_path, monkeypatch):
    """``llmjp-ds health``'s table has a row for each batch and data-phase change, in step order among the events
    (which keep their file order), and ``--plot`` marks them: the changes reach the figure's event lines."""
    import json

    from llmjp_ds.health.report import report

    records = [{"step": s, "loss": 5.0 - 0.1 * s, "global_batch_size": 4 if s < 4 else 8,
                "data_phase": 0 if s < 6 else 1, "attempt": 1} for s in range(1, 9)]
    records.insert(5, {"step": 5, "event": "health", "kind": "loss", "action": "warn", "value": 9.0, "attempt": 1})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rows = [line for line in report(tmp_path) if line.startswith("| ") and not line.startswith(("| step", "| ---"))]
    assert rows == ["| 4 | batch change | global batch 4 -> 8 |", "| 5 | loss spike | warn: value 9 |",
                    "| 6 | data phase | phase 0 -> 1 (data.phases) |"]
    from llmjp_ds.health.report import HEALTH_EVENTS
    from llmjp_ds.metrics import plot

    drawn = {}
    real_draw = plot._draw

    def spy(steps, marked, **kw):
        drawn["marked"] = [(e["step"], e["event"]) for e in marked]
        return real_draw(steps, marked, **kw)

    monkeypatch.setattr(plot, "_draw", spy)
    plot.plot_run(tmp_path, tmp_path / "health.png", events=HEALTH_EVENTS, option="--plot")
    assert drawn["marked"] == [(5, "health"), (4, "batch_change"), (6, "data_phase")]
    assert (tmp_path / "health.png").stat().st_size > 0
