"""Preemption: SIGTERM and SIGINT finish the step, save, exit 0 within ``checkpoint.grace_seconds``; the resumed
run continues exactly; a second SIGINT while the process ends changes nothing. A save that overruns the grace time
is cut off (exit 143) and leaves ``latest`` alone. A signal named in ``checkpoint.stop_signals`` (SIGUSR1, as
Slurm's ``--signal=USR1@120`` sends it) does the same, and one that is not named keeps its default action."""

from __future__ import annotations

import signal
import time

import pytest

from tests.reliability.conftest import (
    DRILL, Proc, assert_latest_complete, check_ok, events, latest_of, loss_trail, run_train, tag_step, train_argv,
    wait_for,
)

GRACE = 30.0
# checkpoints only on a signal and at the end: a checkpoint after a signal is the signal's doing
SETS = [*DRILL, "checkpoint.interval=0", f"checkpoint.grace_seconds={GRACE}"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_and_sigint_twice_save_once_exit_0_and_resume_exactly(baseline, tmp_path):
    _, expected = baseline
    run_dir = tmp_path / "run"
    for sig, after in ((signal.SIGTERM, 3), (signal.SIGINT, 7)):
        # the second SIGINT lands in the interpreter's teardown: a whole interpreter, not one forked by the suite
        proc = Proc(train_argv(run_dir, SETS), fresh=sig == signal.SIGINT)
        assert wait_for(lambda: proc.steps_done() >= after, proc), proc.output()[-3000:]
        sent = time.monotonic()
        proc.signal(sig)
        if sig == signal.SIGINT:
            # a second Ctrl-C as the process ends after its save (the interpreter's teardown, ~1 s with torch
            # loaded, where CPython had put SIG_DFL back: it ended the process by the signal): still exit 0
            assert wait_for(lambda: "[llmjp-ds] done:" in proc.output(), proc, timeout=GRACE), proc.output()[-3000:]
            time.sleep(0.3)  # past the atexit hooks, into the teardown
            assert proc.alive(), "exited before the second SIGINT could be sent"
            proc.signal(signal.SIGINT)
        rc = proc.wait(GRACE + 30)
        took = time.monotonic() - sent
        assert rc == 0, f"{sig.name}: exit {rc}\n{proc.output()[-3000:]}"
        assert took < GRACE, f"{sig.name}: exited {took:.1f}s after the signal (grace {GRACE}s)"
        tag = assert_latest_complete(run_dir)
        assert tag is not None, f"{sig.name}: no checkpoint saved\n{proc.output()[-3000:]}"
        step = tag_step(tag)
        # it finished the step it was in, saved exactly there, and said so
        assert step >= after and step == max(loss_trail(run_dir)), (tag, loss_trail(run_dir))
        assert events(run_dir, "preempted")[-1] == {**events(run_dir, "preempted")[-1], "step": step, "tag": tag}

    # a save that cannot finish within the grace time is cut off by the watchdog: exit 143, latest untouched
    before = latest_of(run_dir)
    proc = Proc(train_argv(run_dir, [*SETS, "checkpoint.grace_seconds=0.001"]))
    assert wait_for(lambda: proc.steps_done() >= tag_step(before) + 1, proc), proc.output()[-3000:]
    proc.signal(signal.SIGTERM)
    assert proc.wait(GRACE) == 143, proc.output()[-3000:]
    assert assert_latest_complete(run_dir) == before

    final = run_train(run_dir, SETS)
    check_ok(final)
    assert loss_trail(run_dir) == expected


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigusr1_as_a_stop_signal_saves_once_exits_0_and_resumes_exactly(baseline, tmp_path):
    """With ``checkpoint.stop_signals=[SIGTERM, USR1]`` SIGUSR1 finishes the step, saves there, logs one
    ``preempted`` event naming SIGUSR1 and exits 0; under the default stop signals SIGUSR1 ends the process by
    its default action (exit -10), saving nothing; the relaunch logs exactly the uninterrupted run's losses."""
    _, expected = baseline
    run_dir = tmp_path / "run"
    proc = Proc(train_argv(run_dir, [*SETS, "checkpoint.stop_signals=[SIGTERM, USR1]"]))
    assert wait_for(lambda: proc.steps_done() >= 3, proc), proc.output()[-3000:]
    proc.signal(signal.SIGUSR1)
    assert proc.wait(GRACE + 30) == 0, proc.output()[-3000:]
    tag = assert_latest_complete(run_dir)
    assert tag is not None and tag_step(tag) >= 3 and tag_step(tag) == max(loss_trail(run_dir)), tag
    (stop,) = events(run_dir, "preempted")
    assert (stop["step"], stop["tag"], stop["reason"]) == (tag_step(tag), tag, "SIGUSR1")

    proc = Proc(train_argv(run_dir, SETS))
    assert wait_for(lambda: proc.steps_done() >= tag_step(tag) + 2, proc), proc.output()[-3000:]
    proc.signal(signal.SIGUSR1)
    assert proc.wait(60) == -signal.SIGUSR1, proc.output()[-3000:]
    assert latest_of(run_dir) == tag and len(events(run_dir, "preempted")) == 1

    check_ok(run_train(run_dir, SETS))
    assert loss_trail(run_dir) == expected
