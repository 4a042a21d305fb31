"""The BF16 -> FP8 flip inside real training runs (DeepSpeed on CPU, emulated FP8): the flip step, exact resume
across it, and the divergence guard's rollback."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.launch import run, train_argv

TINY = ("model.overrides={hidden_size: 64, num_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, "
        "ffn_hidden_size: 128}")
FLIP_AT = 4  # the first FP8 step
PHASES = (f"precision.phases=[{{precision: bf16}}, {{precision: fp8, start_step: {FLIP_AT}, recipe: delayed, "
          "amax_history_len: 4, calibration_steps: 1}]")
BASE = [TINY, "data.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=2", "precision.dtype=fp32",
        "precision.emulate_fp8=true", PHASES, "train.eval_interval=2", "logging.wandb=disabled",
        "optim.warmup_steps=1", "optim.decay_steps=8", "checkpoint.interval=1", "checkpoint.keep_last=10"]


def train(env, run_dir: Path, *sets: str) -> subprocess.CompletedProcess:
    proc = run(train_argv(run_dir, BASE, *sets), timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def trail(run_dir: Path) -> tuple[dict, list]:
    """(each step's current record, every event) from metrics.jsonl: a step the rollback went back over counts as
    its latest attempt logged it."""
    from llmjp_ds.metrics.record import current_steps, events, read_metrics

    records = read_metrics(run_dir)
    return current_steps(records), events(records)


@pytest.fixture(scope="module")
def uninterrupted(env, tmp_path_factory):
    run = tmp_path_factory.mktemp("flip") / "run"
    train(env, run, "train.steps=6")
    return trail(run)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_flip_happens_at_the_configured_step_by_steps_and_by_tokens(env, uninterrupted, tmp_path):
    records, events = uninterrupted
    # the config's start_step is the first step whose record shows FP8, and the flip's event is at it
    assert [records[n]["precision"] for n in range(1, 7)] == ["fp32"] * (FLIP_AT - 1) + ["fp8"] * (7 - FLIP_AT)
    assert records[FLIP_AT]["phase"] == "fp8-delayed-hybrid" and records[FLIP_AT]["emulated_fp8"]
    flips = [e for e in events if e["event"] == "precision_flip"]
    assert [e["step"] for e in flips] == [FLIP_AT]
    # the same flip expressed in tokens: the steps before it read 4 samples x 32 tokens each
    tokens = (FLIP_AT - 1) * 4 * 32
    run = tmp_path / "tokens"
    train(env, run, "train.steps=6", PHASES.replace(f"start_step: {FLIP_AT}", f"start_tokens: {tokens}"))
    by_tokens, _ = trail(run)
    assert [by_tokens[n]["loss"] for n in range(1, 7)] == [records[n]["loss"] for n in range(1, 7)]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("stop_at", [FLIP_AT - 1, FLIP_AT])
def test_resume_at_and_after_the_flip_reproduces_the_trail(env, uninterrupted, tmp_path, stop_at):
    records, _ = uninterrupted
    run = tmp_path / "run"
    train(env, run, f"train.steps={stop_at}")
    train(env, run, "train.steps=6")
    resumed, events = trail(run)
    assert any(e["event"] == "resume" for e in events)
    assert [resumed[n]["loss"] for n in range(1, 7)] == [records[n]["loss"] for n in range(1, 7)]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_injected_divergence_rolls_back_once_and_finishes_in_the_base_precision(env, uninterrupted, tmp_path):
    run = tmp_path / "diverge"
    drill = dict(env, LLMJP_DS_DRILL_NAN_STEPS=str(FLIP_AT + 1), LLMJP_DS_DRILL_NAN_PHASE="fp8")
    proc = train(drill, run, "train.steps=6")
    records, events = trail(run)
    rollbacks = [e for e in events if e["event"] == "rollback"]
    assert len(rollbacks) == 1
    assert rollbacks[0]["step"] == FLIP_AT + 1 and rollbacks[0]["fallback"] == "bf16"
    assert rollbacks[0]["to_step"] <= FLIP_AT
    assert "rolled back" in proc.stdout
    # the diverged timeline's checkpoints are gone; latest is the fallback timeline's newest
    tags = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step"))
    assert all(t.endswith("-r1") or int(t[4:12]) <= rollbacks[0]["to_step"] for t in tags), tags
    assert (run / "checkpoints" / "latest").read_text().strip() == "step00000006-r1"
    assert records[6]["precision"] == "fp32" and all(r["loss"] == r["loss"] for r in records.values())
    # before the failed step the run is the uninterrupted one
    ref, _ = uninterrupted
    assert [records[n]["loss"] for n in range(1, FLIP_AT + 1)] == [ref[n]["loss"] for n in range(1, FLIP_AT + 1)]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fp8_lm_head_starts_alike_quantises_after_the_flip_and_resumes_exactly(env, uninterrupted, tmp_path):
    records, _ = uninterrupted
    head = tmp_path / "fp8-head"
    train(env, head, "train.steps=6", "precision.fp8_lm_head=true")
    fp8_head, _ = trail(head)
    # the same initial model and the same BF16 steps; after the flip the head's GEMMs are quantised as well
    assert [fp8_head[n]["loss"] for n in range(1, FLIP_AT)] == [records[n]["loss"] for n in range(1, FLIP_AT)]
    assert all(fp8_head[n]["loss"] != records[n]["loss"] for n in range(FLIP_AT, 7))
    # its FP8 scaling state travels with the checkpoint: a resume after the flip repeats the trail exactly
    run = tmp_path / "fp8-head-resumed"
    train(env, run, f"train.steps={FLIP_AT}", "precision.fp8_lm_head=true")
    train(env, run, "train.steps=6", "precision.fp8_lm_head=true")
    resumed, events = trail(run)
    assert any(e["event"] == "resume" for e in events)
    assert [resumed[n]["loss"] for n in range(1, 7)] == [fp8_head[n]["loss"] for n in range(1, 7)]
