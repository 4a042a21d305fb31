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
    MetricsLogger, Throughput, format_log_line, peak_flops_for_device, peak_memory_gib, peak_tflops, read_metrics,
)


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
        {"step": 1, "loss": 10.5, "lr": 1e-4, "phase": "bf16"}]
    assert math.isnan(records[1]["loss"])
    assert {k: v for k, v in records[2].items() if k != "time"} == {
        "step": 2, "event": "rollback", "to_step": 1, "reason": "nan loss"}
    assert not (tmp_path / "wandb").exists()


def test_logger_accepts_tensor_and_numpy_scalars(tmp_path):
    import numpy as np
    import torch

    with MetricsLogger(tmp_path, wandb_mode="disabled") as logger:
        logger.log(1, {"loss": torch.tensor(2.5), "grad_norm": np.float32(0.5), "tokens": np.int64(4096)})
    assert read_metrics(tmp_path)[0] | {"time": 0} == {"step": 1, "time": 0, "loss": 2.5, "grad_norm": 0.5,
                                                       "tokens": 4096}


def test_resume_step_drops_records_a_killed_run_left(tmp_path):
    with MetricsLogger(tmp_path, wandb_mode="disabled") as first:
        for step in range(1, 11):
            first.log(step, {"loss": 10.0 - step})
        first.event(7, "rollback", to_step=5)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 11, "loss": 0.')  # torn by the kill

    # Resume from the checkpoint at step 5 with the run id stored in it.
    with MetricsLogger(tmp_path, wandb_mode="disabled", run_id=first.run_id, resume_step=5) as resumed:
        assert resumed.run_id == first.run_id
        assert resumed.dropped == 6  # steps 6..10, the event at 7; the torn line was never a record
        assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
        for step in range(6, 9):
            resumed.log(step, {"loss": 100.0 + step})
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 9))  # no duplicates, no gap
    assert [r["loss"] for r in records] == [9.0, 8.0, 7.0, 6.0, 5.0, 106.0, 107.0, 108.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temp file left behind


def test_a_garbled_line_does_not_stop_a_resume(tmp_path):
    """Bytes that are not UTF-8 (a disk error, a hand edit) in metrics.jsonl: the resume's truncation and
    read_metrics skip that line, as plot does, where opening the file as text raised UnicodeDecodeError."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 2.0}\n\xff\xfe garbled\n{"step": 2, "loss": 1.5}\n{"step": 3, "loss": 1.0}\n')
    with MetricsLogger(tmp_path, wandb_mode="disabled", resume_step=2) as resumed:
        assert resumed.dropped == 1  # step 3; the garbled line was never a record
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(1, 2.0), (2, 1.5)]
    assert b"\xff" not in path.read_bytes()


def test_append_after_a_torn_line_starts_a_new_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    with MetricsLogger(tmp_path, wandb_mode="disabled") as logger:
        logger.log(3, {"loss": 1.0})
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(1, 2.0), (3, 1.0)]


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
        with MetricsLogger({str(tmp_path)!r}, wandb_mode="disabled", resume_step=3) as logger:
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
                       resume_step=2) as resumed:
        assert resumed.run_id == run_id
        resumed.log(3, {"loss": 1.5, "lr": 3e-4, "phase": "fp8"})

    first_again, second = _wandb_records(tmp_path, run_id)
    assert first_again == first
    run_record = next(r["run"] for r in second if r["type"] == "run")
    assert run_record["run_id"] == run_id and run_record["resume"] is True
    assert _history(second) == [{"step": 3, "loss": 1.5, "lr": 3e-4, "phase": "fp8"}]
    assert [(r["step"], r.get("loss"), r.get("event")) for r in read_metrics(tmp_path)] == [
        (1, 4.0, None), (2, 2.0, None), (3, 1.5, None)]
