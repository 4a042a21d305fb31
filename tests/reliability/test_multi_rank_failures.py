"""What ends a multi-rank job, and how fast: one rank's error ends every rank with one tagged line; a rank that
stops answering ends the job after ``parallel.stall_timeout_s``; a write error on one rank during a save keeps
the previous checkpoint; a run directory that is not shared is refused; a checkpoint that cannot be resumed on
the new layout is refused before any process group. Two gloo processes on CPU, launched by
torchrun as users launch them."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.reliability.conftest import (DEEPSPEED_STARTED, DRILL, REPO, TINY, Proc, check_ok, latest_of, loss_trail,
                                        run, run_train, subprocess_env, train_argv, wait_for)

pytestmark = pytest.mark.slow

ENDS_WITHIN = 60  # seconds: the bound for a failed rank to end the job


def torchrun(nproc: int, run_dir, *sets: str, script: list[str] | None = None, nnodes: int = 1, node_rank: int = 0,
             port: int | None = None) -> list[str]:
    from tests.launch import free_port

    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            f"--master_port={port or free_port()}"]
    if nnodes > 1:
        argv += [f"--nnodes={nnodes}", f"--node_rank={node_rank}", "--master_addr=127.0.0.1"]
    argv += script or ["-m", "llmjp_ds.train"]
    for s in (f"run_dir={run_dir}", *TINY, *sets):
        argv += ["--set", s]
    return argv


def tagged_errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: [rank ")]


def our_tracebacks(stderr: str) -> list[str]:
    """Traceback frames in llmjp_ds (torchrun prints its own summary of a failed worker, which is not ours)."""
    return [line for line in stderr.splitlines() if line.strip().startswith("File") and "/llmjp_ds/" in line]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", [(), ("parallel.tensor_parallel=2",)], ids=["dp2", "tp2"])
def test_one_rank_failing_after_init_ends_every_rank_with_one_line(bundled, tmp_path, layout):
    """wandb missing on the rank that logs (the H200 image has none): rank 0 fails after the process group
    exists, while rank 1 goes on to its first collective (under TP2 one inside the forward). Before, rank 0
    waited in an exit barrier and rank 1 in the step's all-reduce until the job was killed."""
    hidden = tmp_path / "no-wandb" / "wandb"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('No module named wandb')\n")
    env = subprocess_env(PYTHONPATH=f"{hidden.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    t0 = time.monotonic()
    result = run(torchrun(2, tmp_path / "run", "train.steps=50", "logging.wandb=offline", *layout), env=env,
                 timeout=180)
    took = time.monotonic() - t0
    assert result.returncode != 0
    assert took < ENDS_WITHIN, f"the job took {took:.0f} s to end"
    lines = tagged_errors(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: [rank 0] wandb (offline) did not start"), lines
    assert not our_tracebacks(result.stderr), result.stderr[-3000:]


@pytest.mark.timeout(300)
def test_a_stopped_rank_ends_the_job_after_the_stall_timeout(bundled, tmp_path):
    """SIGSTOP one rank mid-run (a hung GPU, as seen by its peers): the other rank's watchdog ends it with the
    step and phase it was waiting in, and the launcher ends the stopped one. The rank may be stopped anywhere in
    a step, so the named step and phase are checked against the log lines, not a fixed point (the watchdog
    once named the step index, 0-based, and the last beaten phase while rank 0 waited in the stop request's
    all-reduce after the optimizer: "step 2 (optimizer)" after the line `step 3/400`)."""
    timeout = 8
    proc = Proc(torchrun(2, tmp_path / "run", "train.steps=400", "checkpoint.interval=0",
                         f"parallel.stall_timeout_s={timeout}"))
    try:
        assert wait_for(lambda: proc.steps_done() >= 3, proc, timeout=180), proc.output()[-3000:]
        worker = _worker_pid(proc.p.pid, rank=1)
        os.kill(worker, signal.SIGSTOP)
        t0 = time.monotonic()
        rc = proc.wait(timeout + ENDS_WITHIN)
        took = time.monotonic() - t0
    finally:
        proc.kill()
    assert rc != 0
    assert took < timeout + ENDS_WITHIN, f"the job took {took:.0f} s to end after the stop"
    stalls = [line for line in proc.output().splitlines() if "no progress for" in line]
    assert stalls and stalls[0].startswith("error: [rank 0] no progress for"), proc.output()[-3000:]
    # what rank 0 was waiting in, in the log's numbering, must agree with the progress lines it printed (it
    # prints `step N/400` after step N's optimizer and loss all-reduce, before the stop request's all-reduce):
    # still in step N after its line (the stop check, a save), or in step N+1 before its line
    logged = max(int(line.split()[1].split("/")[0]) for line in proc.lines if line.startswith("step "))
    match = re.search(r"no progress for \d+ s in step (\d+) \(([^)]*)\)", stalls[0])
    assert match, stalls
    step, phase = int(match.group(1)), match.group(2)
    if phase in AFTER_THE_LOG_LINE:
        assert step == logged, (logged, stalls)
    else:
        assert phase in BEFORE_THE_LOG_LINE and step == logged + 1, (logged, stalls)


AFTER_THE_LOG_LINE = {"stop check", "checkpoint"}
BEFORE_THE_LOG_LINE = {"data", "forward", "backward", "optimizer", "loss all-reduce", "logging"}


def _worker_pid(launcher: int, rank: int) -> int:
    """The pid of torchrun's worker with ``RANK=rank`` (a child of the launcher)."""
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            ppid = int(next(line.split()[1] for line in status.read_text().splitlines() if line.startswith("PPid")))
            environ = (status.parent / "environ").read_bytes().split(b"\0")
        except (OSError, StopIteration, ValueError):
            continue
        if ppid == launcher and f"RANK={rank}".encode() in environ:
            return int(status.parent.name)
    raise AssertionError(f"no worker with RANK={rank} under {launcher}")


def _failed_save(mode: str, tag_dir) -> str:
    """How a failed write of checkpoint ``tag_dir`` begins its line: in the save, or found after a background
    write (``checkpoint.async_save``) at the next step boundary."""
    return f"saving checkpoint {tag_dir.name} to " if mode == "sync" else f"writing {tag_dir}/"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_write_error_on_one_rank_keeps_the_previous_checkpoint(bundled, tmp_path, mode):
    """A real size limit on rank 1 only (it writes its ZeRO-1 optimizer shard): the save fails there, the job
    ends with one line naming the path and the free space, ``latest`` still names the previous checkpoint, the
    partial one has no marker and is gone once the job starts again, and the relaunch resumes from it exactly.
    In a synchronous save rank 0 may still be writing into the tag when rank 1 fails: rank 1 removes only its cut
    file, so rank 0 never fails on a directory pulled from under it (a second line, naming the wrong cause)."""
    run_dir = tmp_path / "run"
    sets = ("train.steps=4", "checkpoint.interval=2", "optim.decay_steps=8",
            f"checkpoint.async_save={mode == 'async'}")
    check_ok(run(torchrun(2, run_dir, *sets[1:], "train.steps=2")))
    assert latest_of(run_dir) == "step00000002"
    env = subprocess_env(LIMIT_RANK="1", LIMIT_BYTES=str(256 * 1024))
    t0 = time.monotonic()
    failed = run(torchrun(2, run_dir, *sets, script=[str(REPO / "tests/reliability/limited_rank.py")]), env=env)
    assert failed.returncode != 0 and time.monotonic() - t0 < 120
    lines = tagged_errors(failed.stderr)
    assert len(lines) == 1, failed.stderr[-3000:]
    prefix = "error: [rank 1] " + _failed_save(mode, run_dir / "checkpoints" / "step00000004")
    assert lines[0].startswith(prefix) and "GiB free" in lines[0], lines
    assert "still names the complete checkpoint step00000002" in lines[0], lines
    assert latest_of(run_dir) == "step00000002"
    partial = run_dir / "checkpoints" / "step00000004"
    assert not (partial / "llmjp_ds.json").exists()
    logged = loss_trail(run_dir)  # rank 0 logged steps 3 and 4 before the save failed
    if mode == "sync":  # rank 0's files stay until the next start; rank 1's cut shard is gone
        left = sorted(p.name for p in partial.rglob("*") if p.is_file())
        assert left and not [name for name in left if "zero_pp_rank_1_" in name], left
        check_ok(run(torchrun(2, run_dir, "train.steps=2", *sets[1:])))  # starts at step 2: nothing to train
    assert not partial.exists(), "the incomplete tag is gone (async: once the ranks agreed the save failed)"
    check_ok(run(torchrun(2, run_dir, *sets)))
    resumed = loss_trail(run_dir)
    assert latest_of(run_dir) == "step00000004"
    assert [resumed[s] for s in (3, 4)] == [logged[s] for s in (3, 4)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_single_process_save_under_a_size_limit_fails_cleanly_and_resumes_exactly(baseline, tmp_path, mode):
    """The same with one process, against the uninterrupted baseline run."""
    run_dir = tmp_path / "run"
    check_ok(run_train(run_dir, DRILL, "train.steps=2", "optim.decay_steps=30"))
    env = subprocess_env(LIMIT_BYTES=str(256 * 1024))
    failed = run([sys.executable, str(REPO / "tests/reliability/limited_rank.py"),
                  *train_argv(run_dir, DRILL, f"checkpoint.async_save={mode == 'async'}")[3:]], env=env)
    assert failed.returncode == 2
    lines = [line for line in failed.stderr.splitlines() if line.startswith("error: ")]
    prefix = "error: " + _failed_save(mode, run_dir / "checkpoints" / "step00000003")
    assert len(lines) == 1 and lines[0].startswith(prefix), lines
    assert "GiB free" in lines[0] and ("File too large" in lines[0] or "a write was cut short" in lines[0]), lines
    assert latest_of(run_dir) == "step00000002"
    check_ok(run_train(run_dir, DRILL, "train.steps=5", "optim.decay_steps=30"))
    _, reference = baseline
    assert [loss_trail(run_dir)[s] for s in range(1, 6)] == [reference[s] for s in range(1, 6)]


@pytest.mark.timeout(240)
def test_a_run_directory_that_is_not_shared_is_refused(bundled, tmp_path):
    """Two 'nodes' (torchrun --nnodes=2 on one machine) whose relative run_dir resolves to two directories, as a
    node-local path does on a cluster: rank 1 cannot read rank 0's token, and the job ends before writing."""
    from tests.launch import free_port

    port, procs = free_port(), []
    for node in (0, 1):
        (tmp_path / f"node{node}").mkdir()
        procs.append(Proc(torchrun(1, "run", "train.steps=3", nnodes=2, node_rank=node, port=port),
                          env=subprocess_env(PYTHONPATH=str(REPO)), cwd=tmp_path / f"node{node}"))
    try:
        outputs = [(p.wait(ENDS_WITHIN + 60), p.output()) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(rc != 0 for rc, _ in outputs), outputs
    lines = [line for _, out in outputs for line in out.splitlines() if line.startswith("error: [rank ")]
    assert len(lines) == 1 and lines[0].startswith("error: [rank 1] run_dir run is not shared by every rank"), lines
    assert not (tmp_path / "node0" / "run" / "checkpoints").exists()
    assert not (tmp_path / "node1" / "run" / "checkpoints").exists()


@pytest.mark.timeout(240)
def test_a_zero2_checkpoint_on_another_layout_is_refused_in_one_line(bundled, tmp_path):
    """A resume on another layout converts ZeRO-1 checkpoints only: a ZeRO-2 run of two ranks relaunched on one
    gets one line naming both layouts before any process group starts, and its checkpoint is untouched."""
    run_dir = tmp_path / "run"
    check_ok(run(torchrun(2, run_dir, "train.steps=2", "parallel.zero_stage=2")))
    before = sorted(p.name for p in (run_dir / "checkpoints" / "step00000002").iterdir())
    result = run(train_argv(run_dir, TINY, "train.steps=4", "parallel.zero_stage=2"))
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert lines[0].endswith("step00000002 was saved on PP1 x DP2 with ZeRO-2; resuming it on PP1 x DP1 (ZeRO-2) "
                             "works with ZeRO-1 on both sides only: relaunch on PP1 x DP2 with "
                             "parallel.zero_stage=2"), lines
    assert not any(marker in result.stdout + result.stderr for marker in DEEPSPEED_STARTED)
    assert sorted(p.name for p in (run_dir / "checkpoints" / "step00000002").iterdir()) == before


@pytest.mark.timeout(60)
def test_the_watchdog_names_the_stop_check_after_the_log_line_in_the_logs_numbering(monkeypatch):
    """In process, no rank stopped: the loop's step index 2 (the log's `step 3/N`) beat its optimizer phase, then
    the trainer's after-step code logged and entered the stop request's all-reduce, where a stalled peer would
    keep it. The watchdog, asked there, names step 3 and the stop check (it said "step 2 (optimizer)")."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from llmjp_ds.parallel.context import ParallelContext
    from llmjp_ds.launch.failure import Watchdog
    from llmjp_ds.trainer import Trainer

    watchdog = Watchdog(60, rank=0)
    watchdog.beat("data", 3)
    watchdog.beat("optimizer")
    seen = []
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, *a, **k: seen.append(watchdog.where()))
    ctx = ParallelContext.__new__(ParallelContext)
    ctx.rank, ctx.device = 0, torch.device("cpu")
    cfg = SimpleNamespace(train=SimpleNamespace(eval_interval=0, steps=10),
                          logging=SimpleNamespace(interval=1, progress=False),
                          checkpoint=SimpleNamespace(interval=0, keep=[]))
    trainer = SimpleNamespace(cfg=cfg, state=SimpleNamespace(step=3), ctx=ctx, stop=SimpleNamespace(requested=False),
                              logger=SimpleNamespace(log=lambda step, metrics: None, failure=None), watchdog=watchdog,
                              checkpointer=SimpleNamespace(commit=lambda step, block: None),  # no save in flight
                              say=lambda line: None)
    assert Trainer._after_step(trainer, {"loss": 1.0}) is False
    assert seen == ["in step 3 (stop check)"], seen
    assert Watchdog(60, rank=0).where() == "before step 1 (setup)"
