"""A run directory keeps its files whatever happens to it: one owner at a time (an flock, released by any exit,
kill -9 included; a relaunch refused while the owner is stopping says so, and ``--wait-for-run-dir`` waits for
it), a resume that verifies a checkpoint against its manifest and falls back to the newest intact one, exactly,
and pruning that never deletes through a link. Real CLI subprocesses on the tiny fp32 run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.reliability.conftest import (DRILL, DRILL_STEPS, TINY, Proc, check_ok, events, latest_of, loss_trail,
                                        read_records, run, run_train, subprocess_env, train_argv, wait_for)
from tests.reliability.test_multi_rank_failures import torchrun

MODEL = "mp_rank_00_model_states.pt"


def copy_run(baseline, tmp_path: Path, name: str = "run") -> Path:
    dst = tmp_path / name
    shutil.copytree(baseline[0], dst)
    return dst


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_run_directory_has_one_owner(bundled, tmp_path):
    """A second training into a running one's run_dir ends within seconds with one line naming the holder's host
    and pid, on every rank of a 2-rank job too; the first run goes on undisturbed (its metrics hold its own
    steps once each); after it is killed with -9, the directory can be trained in again at once."""
    run_dir = tmp_path / "run"
    first = Proc([sys.executable, "-m", "llmjp_ds.train", "--set", f"run_dir={run_dir}",
                  *sum((["--set", s] for s in [*TINY, "train.steps=400", "checkpoint.interval=0"]), [])])
    try:
        assert wait_for(lambda: first.steps_done() >= 2, first, timeout=180), first.output()[-3000:]
        holder = f"pid {first.p.pid} on {socket.gethostname()}"
        t0 = time.monotonic()
        second = run_train(run_dir, [*TINY, "train.steps=3"], timeout=120)
        took = time.monotonic() - t0
        lines = second.stderr.strip().splitlines()
        assert second.returncode != 0 and len(lines) == 1, second.stderr[-3000:]
        assert lines[0].startswith(f"error: run_dir {run_dir} is in use by another training ({holder}, started "), \
            lines
        assert "choose another run_dir (two trainings must never share one)" in lines[0]
        assert took < 30, f"the second launch took {took:.0f} s to end"
        # a 2-rank job: rank 0 cannot take the lock and ends at once; the launcher may stop rank 1 before it
        # looks, so rank 1's own refusal is checked alone below
        pair = run(torchrun(2, run_dir, "train.steps=3"), timeout=120)
        refusals = [line for line in pair.stderr.splitlines() if line.startswith("error: run_dir")]
        assert pair.returncode != 0 and 1 <= len(refusals) <= 2 and all(holder in r for r in refusals), \
            pair.stderr[-3000:]
        # rank 1 of another job (its rendezvous named; no rank 0 needed, the check comes before the process
        # group) sees the directory held and ends with the same one line
        other_job = subprocess_env(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
        rank1 = run(train_argv(run_dir, [*TINY, "train.steps=3"]), env=other_job, timeout=120)
        lines = rank1.stderr.strip().splitlines()
        assert rank1.returncode != 0 and len(lines) == 1, rank1.stderr[-3000:]
        assert lines[0].startswith(f"error: run_dir {run_dir} is in use by another training ({holder}, started "), \
            lines
        assert first.alive()
        done = first.steps_done()
        assert wait_for(lambda: first.steps_done() >= done + 2, first, timeout=120)
        steps = [r["step"] for r in read_records(run_dir) if "loss" in r and "event" not in r]
        assert steps == list(range(1, len(steps) + 1)), steps  # the refused launches wrote no record
        first.signal(signal.SIGKILL)
        first.wait(60)
    finally:
        first.kill()
    # the kernel released the lock with the process: the directory is free again
    after = run_train(run_dir, [*TINY, "train.steps=2", "checkpoint.interval=0"], timeout=180)
    check_ok(after)
    assert json.loads((run_dir / ".llmjp_ds.lock").read_text())["pid"] != first.p.pid


# each file of the holder's last save waits this long: the window in which it is stopping but still holds the lock
SLOW_SAVE_S = 8


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_relaunch_waits_for_a_holder_that_is_stopping(bundled, tmp_path):
    """The holder got SIGTERM and is writing its last checkpoint (slowed): a relaunch with ``--wait-for-run-dir
    120`` says once that it waits, for whom and why; one without it ends at once with one line saying the holder
    is stopping, since when and how long its save may still take; the holder saves and exits 0, and the waiting
    relaunch then starts and resumes from that checkpoint to the end."""
    run_dir = tmp_path / "run"
    sets = [*DRILL, "checkpoint.interval=0", "checkpoint.grace_seconds=60"]
    holder = Proc(train_argv(run_dir, sets), env=subprocess_env(LLMJP_DS_DRILL_SLOW_WRITE_S=str(SLOW_SAVE_S)))
    waiter = None
    try:
        assert wait_for(lambda: holder.steps_done() >= 3, holder), holder.output()[-3000:]
        holder.signal(signal.SIGTERM)
        assert wait_for((run_dir / ".llmjp_ds.stopping").is_file, holder, timeout=30), holder.output()[-3000:]
        waiter = Proc([*train_argv(run_dir, sets), "--wait-for-run-dir", "120"])
        assert wait_for(lambda: "(--wait-for-run-dir)" in waiter.output(), waiter, timeout=60), waiter.output()
        refused = run_train(run_dir, sets, timeout=60)
        assert holder.alive(), f"the holder ended before the refusal: raise SLOW_SAVE_S\n{refused.stderr}"
        holder_is = f"is in use by another training (pid {holder.p.pid} on {socket.gethostname()}, started "
        lines = refused.stderr.strip().splitlines()
        assert refused.returncode != 0 and len(lines) == 1, refused.stderr[-3000:]
        assert holder_is in lines[0] and ", which is stopping (SIGTERM at " in lines[0], lines[0]
        left = re.search(r"its save has at most (\d+) s left of checkpoint.grace_seconds\): relaunch with "
                         r"--wait-for-run-dir (\d+) to wait for it$", lines[0])
        assert left and 0 < int(left[1]) <= 60 and int(left[2]) == int(left[1]) + 10, lines[0]
        assert holder.wait(60) == 0, holder.output()[-3000:]
        saved = latest_of(run_dir)
        assert waiter.wait(120) == 0, waiter.output()[-3000:]
    finally:
        holder.kill()
        if waiter is not None:
            waiter.kill()
    (told,) = [line for line in waiter.lines if "(--wait-for-run-dir)" in line]
    assert told.startswith(f"[llmjp-ds] run_dir {run_dir} {holder_is}") and "which is stopping (SIGTERM at " in told
    assert told.rstrip().endswith("waiting up to 120 s for it to end (--wait-for-run-dir)"), told
    (stop,) = events(run_dir, "preempted")
    (resume,) = events(run_dir, "resume")  # the waiter's start, from the checkpoint the holder saved as it ended
    assert saved == stop["tag"] == resume["tag"] and resume["step"] == stop["step"] >= 3
    assert latest_of(run_dir) == f"step{DRILL_STEPS:08d}"


def test_a_wait_for_the_run_dir_ends_with_the_holder_or_times_out(tmp_path, monkeypatch, capsys):
    """In-process: ``acquire(wait_s)`` takes the lock once its holder releases it, after one line saying it
    waits; a holder that outlasts the wait gets today's refusal with ``(waited N s)``; a rank of another job
    (``check_peer``) waits the same way; a stopping record of an earlier owner is not read as this one's."""
    from llmjp_ds.checkpoint import lock
    from llmjp_ds.checkpoint.lock import STOPPING, RunDirLock
    from llmjp_ds.errors import UserError

    monkeypatch.setattr(lock, "SETTLE_S", 0.1)  # a peer believes another job's record at once (see below)
    first = RunDirLock(tmp_path / "r").acquire()
    with pytest.raises(UserError, match=r"started [^)]*\) \(waited 0.6 s\): wait for it to end \(or relaunch with "
                                        r"--wait-for-run-dir SECONDS\)"):
        RunDirLock(tmp_path / "r").acquire(wait_s=0.6)
    assert capsys.readouterr().out.count("waiting up to 0.6 s for it to end (--wait-for-run-dir)") == 1
    threading.Timer(0.6, first.release).start()
    t0 = time.monotonic()
    second = RunDirLock(tmp_path / "r").acquire(wait_s=30)
    assert second.held and second.waited and time.monotonic() - t0 < 10
    # a rank of another job (its rendezvous named) waits while this process holds the directory
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    threading.Timer(0.6, second.release).start()
    peer = RunDirLock(tmp_path / "r")
    peer.check_peer(wait_s=30)
    assert peer.waited
    # a stopping record is read only while its writer holds the directory
    third = RunDirLock(tmp_path / "r").acquire()
    third.mark_stopping("SIGUSR1", 600)
    with pytest.raises(UserError, match=r"which is stopping \(SIGUSR1 at \d\d:\d\d:\d\d; its save has at most 600 s "):
        RunDirLock(tmp_path / "r").acquire()
    record = (tmp_path / "r" / STOPPING).read_text()
    third.release()
    fourth = RunDirLock(tmp_path / "r").acquire()
    assert not (tmp_path / "r" / STOPPING).exists()  # the new owner removed the earlier one's record
    (tmp_path / "r" / STOPPING).write_text(record)
    with pytest.raises(UserError) as info:
        RunDirLock(tmp_path / "r").acquire()
    assert "stopping" not in str(info.value)
    fourth.release()


def _trail_matches(run_dir: Path, baseline_trail: dict, since: int) -> None:
    trail = loss_trail(run_dir)
    assert {s: trail[s] for s in range(since + 1, DRILL_STEPS + 1)} == \
        {s: baseline_trail[s] for s in range(since + 1, DRILL_STEPS + 1)}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("damage", ["truncated", "empty", "planted-without-manifest"])
def test_a_damaged_checkpoint_falls_back_to_the_intact_one_exactly(baseline, tmp_path, damage):
    """``latest`` names a tag whose model states a crash cut short (half the bytes, or none), or into which
    someone planted a pickle without fixing the manifest: the resume names the damaged tag in one warning,
    records a ``checkpoint_fallback`` event, sets the tag aside (kept, not deleted), resumes from the tag before
    it and logs exactly the uninterrupted run's losses from there; the planted code never runs."""
    run_dir = copy_run(baseline, tmp_path)
    path = run_dir / "checkpoints" / "step00000030" / MODEL
    canary = tmp_path / "canary"
    if damage == "planted-without-manifest":
        from tests.reliability.cases_checkpoint import Payload

        state = torch.load(path, map_location="cpu", weights_only=False)
        state["train_state"] = Payload(canary, "system")
        torch.save(state, path)
    else:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"")
    damaged_bytes = path.read_bytes()
    result = run_train(run_dir, DRILL)
    check_ok(result)
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: checkpoint")]
    assert len(warnings) == 1 and "step00000030 is damaged (" in warnings[0] and \
        "resuming from step00000029" in warnings[0], result.stderr[-3000:]
    assert MODEL in warnings[0]
    (event,) = events(run_dir, "checkpoint_fallback")
    assert event["damaged"] == "step00000030" and event["tag"] == "step00000029" and event["step"] == 29
    assert (run_dir / "checkpoints" / "step00000030.damaged" / MODEL).read_bytes() == damaged_bytes
    assert latest_of(run_dir) == "step00000030"  # saved again, from the intact timeline
    _trail_matches(run_dir, baseline[1], since=29)
    assert not canary.exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pruning_never_deletes_through_a_link(baseline, tmp_path):
    """A tag that is a symbolic link to a directory outside the run (with a marker, so it looks complete), and a
    link inside a real tag to an outside file: pruning removes the links and nothing they point to."""
    run_dir = copy_run(baseline, tmp_path)
    outside = tmp_path / "elsewhere"
    shutil.copytree(run_dir / "checkpoints" / "step00000029", outside)
    (outside / "precious.txt").write_text("someone else's data")
    before = {p.name: p.read_bytes() for p in outside.iterdir()}
    (run_dir / "checkpoints" / "step00000010").symlink_to(outside)
    (tmp_path / "other.txt").write_text("keep me")
    (run_dir / "checkpoints" / "step00000029" / "link.txt").symlink_to(tmp_path / "other.txt")
    check_ok(run_train(run_dir, [*DRILL, "train.steps=32"]))
    tags = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step"))
    assert tags == ["step00000031", "step00000032"], tags
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before
    assert (tmp_path / "other.txt").read_text() == "keep me"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_export_force_replaces_an_earlier_export_only(baseline, tmp_path):
    """``--force`` over an earlier export replaces it (and the new one carries the marker again); the refusals
    (a run, its parent, a checkpoint, a plain directory) are cases of the bad-input catalogue."""
    out = tmp_path / "hf"
    argv = [sys.executable, "-m", "llmjp_ds.cli", "export", "--run", str(baseline[0]), "--output", str(out),
            "--dtype", "fp32"]
    check_ok(run(argv, timeout=180))
    made = json.loads((out / "llmjp_ds_export.json").read_text())
    assert made["tag"] == "step00000030" and made["run_dir"] == str(baseline[0].resolve())
    (out / "stale.txt").write_text("from the earlier export")
    check_ok(run([*argv, "--tag", "step00000029", "--force"], timeout=180))
    assert json.loads((out / "llmjp_ds_export.json").read_text())["tag"] == "step00000029"
    assert not (out / "stale.txt").exists()
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(str(out)).config.model_type == "llama"


def test_a_peer_rank_waits_for_its_rank_0_to_replace_the_last_owners_record(tmp_path, monkeypatch):
    """In-process: this job's rank 0 takes the lock, then replaces the record of the directory's last owner (a
    resumed or copied run keeps it in the lock file). A rank that looks in between reads that record under a held
    lock; it must not take it for a live holder of another job. A record that stands is refused, after
    ``SETTLE_S``."""
    import fcntl

    from llmjp_ds.checkpoint import lock
    from llmjp_ds.checkpoint.lock import RunDirLock
    from llmjp_ds.errors import UserError

    monkeypatch.setattr(lock, "SETTLE_S", 1.0)
    run_dir = tmp_path / "r"
    RunDirLock(run_dir).acquire().release()  # the last owner, a lone process: its record stays in the file
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    rank0 = os.open(run_dir / lock.LOCK, os.O_RDWR)
    fcntl.flock(rank0, fcntl.LOCK_EX)  # rank 0 has the lock, and has not yet written its own record

    def write_record():
        os.ftruncate(rank0, 0)
        os.pwrite(rank0, json.dumps({"pid": os.getpid(), "job": "127.0.0.1:29500"}).encode(), 0)

    threading.Timer(0.3, write_record).start()
    t0 = time.monotonic()
    RunDirLock(run_dir).check_peer()  # returns: the record became this job's
    assert time.monotonic() - t0 < 1.0
    os.close(rank0)
    holder = RunDirLock(run_dir).acquire()  # a live holder, of the job at port 29500
    monkeypatch.setenv("MASTER_PORT", "29501")  # this rank's job is another one
    t0 = time.monotonic()
    with pytest.raises(UserError, match="is in use by another training"):
        RunDirLock(run_dir).check_peer()
    assert 1.0 <= time.monotonic() - t0 < 5.0
    holder.release()


def test_the_lock_is_released_by_the_kernel(tmp_path):
    """In-process: a held lock refuses a second holder with the first one's pid; closing it (what any exit does)
    frees the directory."""
    from llmjp_ds.checkpoint.lock import RunDirLock
    from llmjp_ds.errors import UserError

    first = RunDirLock(tmp_path / "r").acquire()
    with pytest.raises(UserError, match=f"pid {os.getpid()} on {socket.gethostname()}"):
        RunDirLock(tmp_path / "r").acquire()
    with pytest.raises(UserError, match="is in use by another training"):
        RunDirLock(tmp_path / "r").check_peer()  # a rank of another job (this process has no job id)
    first.release()
    RunDirLock(tmp_path / "r").acquire().release()
    # the same directory spelled another way is the same lock
    held = RunDirLock(tmp_path / "r").acquire()
    with pytest.raises(UserError):
        RunDirLock(tmp_path / "x" / ".." / "r").acquire()
    held.release()
