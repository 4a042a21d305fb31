"""When the disk goes away under a training: filled by another process between two saves, full when the run starts,
and a run directory whose filesystem is lazily unmounted (as a lost network mount looks). Each on a small
filesystem the test mounts (skipped with the reason where mounting is not allowed), each against the uninterrupted
run of the same steps: one ``error:`` line, a non-zero exit, nothing written outside the run directory, the record
kept as it was, and, once the disk is back, a resume that ends exactly where the uninterrupted run does."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests import disk
from tests.reliability.conftest import (
    DRILL_STEPS, TINY, Proc, check_ok, latest_of, loss_trail, run, run_train, train_argv, wait_for,
)

# the baseline's 30 steps (its LR schedule), one save at step 10 and one at the end: after step 12 the disk goes
# away, and the run writes nothing but its records until step 30 (a record still fits into the last page of the
# file a few times on a full tmpfs: some steps go by before one does not)
SETS = [*TINY, f"train.steps={DRILL_STEPS}", "checkpoint.interval=0", "checkpoint.keep=[{below: 11, every: 10}]"]
STOP_AFTER = 12


def one_error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in output, output[-3000:]
    return lines[0]


def stopped_after_step(proc: Proc, step: int) -> int:
    """Stop ``proc`` (SIGSTOP, its process group) once it has logged ``step``; the last step it had logged then
    (a tiny step takes milliseconds: it may be a few steps further), which must lie before the next save."""
    assert wait_for(lambda: proc.steps_done() >= step, proc, timeout=180), proc.output()[-3000:]
    proc.signal(signal.SIGSTOP)
    time.sleep(0.5)  # the lines it printed before it stopped
    logged = proc.steps_done()
    assert logged < 20, f"the run went on to step {logged} before it was stopped"
    return logged


def resumed_exactly(run_dir, baseline, before: bytes) -> None:
    """The same command once the disk is back: it ends as the uninterrupted run does, and the record still begins
    with every byte written before."""
    check_ok(run_train(run_dir, SETS))
    assert latest_of(run_dir) == f"step{DRILL_STEPS:08d}"
    assert loss_trail(run_dir) == baseline[1]
    assert (run_dir / "metrics.jsonl").read_bytes().startswith(before)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_disk_filled_between_saves(baseline, tmp_path):
    """Another process fills the disk after step 12 (saved at step 10): a step's record soon cannot be written.
    The run tries a checkpoint of that step (which cannot fit either), ends with one line saying both, and keeps
    step 10's checkpoint; the record keeps the steps logged before as they were."""
    with disk.tmpfs(tmp_path / "disk", "64m") as d:
        run_dir = d / "run"
        proc = Proc(train_argv(run_dir, [*SETS, "checkpoint.async_save=false"]))
        try:
            logged = stopped_after_step(proc, STOP_AFTER)
            filler = disk.fill(d)
            proc.signal(signal.SIGCONT)
            rc = proc.wait(120)
        finally:
            proc.kill()
        line = one_error_line(proc.output())
        assert rc != 0
        assert line.startswith(f"error: writing {run_dir}/metrics.jsonl failed (No space left on device (ENOSPC); ")
        assert "and the checkpoint after it could not be saved either: saving checkpoint step" in line
        # the first record that needed a page the disk no longer had (the file's last page took a few more)
        failed_at = int(line.split("saving checkpoint step")[1][:8])
        assert logged < failed_at < DRILL_STEPS and line.endswith("latest still names the complete checkpoint step00000010"), line
        assert sorted(os.listdir(d)) == [".filler", "run"]
        before = (run_dir / "metrics.jsonl").read_bytes()
        steps = sorted(loss_trail(run_dir))
        assert steps == list(range(1, failed_at)) and before.endswith(b"\n")  # that record: not a byte of it
        filler.unlink()
        resumed_exactly(run_dir, baseline, before)
        print(line)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("free_kib", [0, 64])
def test_a_full_disk_at_the_start(baseline, tmp_path, free_kib):
    """A new run on a full disk (nothing free: the lock's record; 64 KiB: room for the run's small files, not for its
    tokenizer): one line naming the file and the space, and no run directory left behind (no .tokenizer.tmp/);
    once there is room, the same command trains the run from its first step."""
    with disk.tmpfs(tmp_path / "disk", "64m") as d:
        run_dir = d / "run"
        filler = disk.fill(d, leave=free_kib * 1024)
        result = run(train_argv(run_dir, SETS, "train.steps=6"))
        line = one_error_line(result.stdout + result.stderr)
        assert result.returncode != 0
        what = run_dir / (".llmjp_ds.lock" if free_kib == 0 else "tokenizer")
        assert line.startswith(f"error: cannot write {what} (No space left on device (ENOSPC); "), line
        assert line.endswith("free there): free space or choose another run_dir, then start again"), line
        assert sorted(os.listdir(d)) == [".filler"]  # the run directory it made is gone again
        filler.unlink()
        check_ok(run_train(run_dir, SETS, "train.steps=6"))
        assert loss_trail(run_dir) == {s: baseline[1][s] for s in range(1, 7)}
        print(line)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_directory_unmounted_under_the_run(baseline, tmp_path):
    """The run directory's filesystem goes away (``umount -l`` of its mount) after step 12: the run notices before
    its next write, ends with one line naming it, and writes nothing into the bare mount point left at that path.
    Mounted back, the run resumes from its last checkpoint to the uninterrupted run's end, its record whole."""
    with disk.tmpfs(tmp_path / "disk", "64m") as source:
        mount = tmp_path / "mount"
        disk.bind(source, mount)
        try:
            run_dir = mount / "run"
            # saves in the loop: between its saves the run writes nothing but its records, each write checked (a
            # background save's commit, checked too, could be past its check when the mount goes)
            proc = Proc(train_argv(run_dir, [*SETS, "checkpoint.async_save=false"]))
            try:
                stopped_after_step(proc, STOP_AFTER)
                disk.umount(mount, lazy=True)
                proc.signal(signal.SIGCONT)
                rc = proc.wait(120)
            finally:
                proc.kill()
            line = one_error_line(proc.output())
            assert rc != 0
            assert line == (f"error: run_dir {run_dir} is no longer the directory this run locked: its lock file "
                            ".llmjp_ds.lock is gone (its filesystem unmounted, or the directory moved or removed?); "
                            "the run ends without writing there: mount or move it back, then resume from its latest "
                            "checkpoint"), line
            assert os.listdir(mount) == []  # nothing written into the mount point it left
            before = (source / "run" / "metrics.jsonl").read_bytes()
            disk.bind(source, mount)
            resumed_exactly(run_dir, baseline, before)
            print(line)
        finally:
            disk.umount(mount, lazy=True)
