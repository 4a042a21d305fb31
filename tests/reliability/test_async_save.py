"""Background checkpoints (``checkpoint.async_save``, the default) keep every crash guarantee of a synchronous
save: the same trail bit for bit (one process, DP2, PP2), a kill -9 in the middle of a background write resumes
exactly from the previous tag, and SIGTERM waits for the write in flight, then saves and exits 0. The drill
``LLMJP_DS_DRILL_SLOW_WRITE_S`` slows the writer so that steps run while a write is in flight. A write that
fails on one rank: ``test_multi_rank_failures.py`` (both modes)."""

from __future__ import annotations

import json
import signal

import pytest
import torch

from tests.reliability.conftest import (DRILL, DRILL_STEPS, TINY, Proc, check_ok, events, latest_of, loss_trail, run,
                                        run_train, subprocess_env, train_argv, wait_for)
from tests.reliability.test_multi_rank_failures import torchrun

SLOW = "LLMJP_DS_DRILL_SLOW_WRITE_S"
MODEL = "mp_rank_00_model_states.pt"


def _weights(run_dir) -> dict:
    tag = latest_of(run_dir)
    state = torch.load(run_dir / "checkpoints" / tag / MODEL, map_location="cpu", weights_only=False)
    return {k: v for k, v in state["module"].items() if isinstance(v, torch.Tensor)}


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _stalls(run_dir) -> list[dict]:
    return [r for r in _records(run_dir) if "save_stall_s" in r]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_one_process_async_equals_sync_bit_for_bit(baseline, tmp_path):
    """The baseline saves in the background every step; a synchronous run and a background run whose writer is
    slowed (each write spans several steps) log the same losses and end with the same weights."""
    sync, slow = tmp_path / "sync", tmp_path / "slow"
    check_ok(run_train(sync, [*DRILL, "checkpoint.async_save=false"]))
    check_ok(run(train_argv(slow, [*DRILL, "checkpoint.interval=3"]), env=subprocess_env(**{SLOW: "0.2"})))
    for run_dir in (sync, slow):
        assert loss_trail(run_dir) == baseline[1]
    reference = _weights(baseline[0])
    for run_dir in (sync, slow):
        assert _weights(run_dir).keys() == reference.keys()
        assert all(torch.equal(_weights(run_dir)[k], v) for k, v in reference.items())
    committed = events(slow, "checkpoint_committed")
    assert [e["tag"] for e in committed][:2] == ["step00000003", "step00000006"], committed
    assert all(e["write_s"] >= 0.2 for e in committed)  # each file waits 0.2 s: the write spanned steps
    # every save's stall is reported with the next step; a background write's duration with the step after its
    # commit, which comes with the next save or earlier, as the write and the steps race
    assert len(_stalls(sync)) == DRILL_STEPS - 1 and len(_stalls(slow)) == DRILL_STEPS // 3 - 1
    written = [r["checkpoint_write_s"] for r in _records(slow) if "checkpoint_write_s" in r]
    assert written and all(s >= 0.2 for s in written) and not any("checkpoint_write_s" in r for r in _records(sync))


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", ["dp2", "pp2"])
def test_two_ranks_async_equals_sync_bit_for_bit(bundled, tmp_path, layout):
    sets = ["train.steps=8", "checkpoint.interval=2", "optim.decay_steps=8"]
    if layout == "pp2":
        sets += ["parallel.pipeline_stages=2", "parallel.zero_stage=1"]
    trails = {}
    for mode in ("sync", "async"):
        run_dir = tmp_path / mode
        env = subprocess_env(**({SLOW: "0.1"} if mode == "async" else {}))
        check_ok(run(torchrun(2, run_dir, *sets, f"checkpoint.async_save={mode == 'async'}"), env=env,
                     timeout=300))
        trails[mode] = loss_trail(run_dir)
        assert latest_of(run_dir) == "step00000008"
    assert trails["async"] == trails["sync"] and len(trails["sync"]) == 8


def _start_slow(run_dir, *sets: str) -> Proc:
    """The drill run, a checkpoint every 3 steps, each file's write slowed to 1.5 s (a write spans ~10 steps)."""
    return Proc(train_argv(run_dir, [*DRILL, "checkpoint.interval=3", *sets]), env=subprocess_env(**{SLOW: "1.5"}))


def _write_in_flight(run_dir, proc: Proc) -> None:
    """Wait until step 3's checkpoint is committed and step 6's write is under way (step 7 logged)."""
    assert wait_for(lambda: latest_of(run_dir) == "step00000003" and proc.steps_done() >= 7, proc, timeout=180), \
        proc.output()[-3000:]
    assert latest_of(run_dir) == "step00000003"
    assert not (run_dir / "checkpoints" / "step00000006" / "llmjp_ds.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kill_9_during_a_background_write_resumes_from_the_previous_tag_exactly(baseline, tmp_path):
    run_dir = tmp_path / "run"
    proc = _start_slow(run_dir)
    try:
        _write_in_flight(run_dir, proc)
        proc.signal(signal.SIGKILL)
        proc.wait(60)
    finally:
        proc.kill()
    assert latest_of(run_dir) == "step00000003"
    check_ok(run_train(run_dir, DRILL))
    assert events(run_dir, "resume")[-1]["tag"] == "step00000003"
    assert loss_trail(run_dir) == baseline[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_during_a_background_write_commits_it_then_saves_once(baseline, tmp_path):
    run_dir = tmp_path / "run"
    proc = _start_slow(run_dir, "checkpoint.keep_last=3")
    try:
        _write_in_flight(run_dir, proc)
        proc.signal(signal.SIGTERM)
        rc = proc.wait(120)
    finally:
        proc.kill()
    assert rc == 0, proc.output()[-3000:]
    (stop,) = events(run_dir, "preempted")
    tag = latest_of(run_dir)
    # the signal came after step 7's line, which precedes that step's stop check: the stop saves step 7 or later
    assert tag == stop["tag"] and int(tag[4:]) == stop["step"] >= 7
    # the write in flight committed first, then the stop's own save: one each
    assert [e["tag"] for e in events(run_dir, "checkpoint_committed")] == ["step00000003", "step00000006", tag]
    assert (run_dir / "checkpoints" / "step00000006" / "llmjp_ds.json").is_file()
    # step 6's save waited for step 3's write (1.5 s a file, ~10 steps): said once, with the interval that fits
    (waited,) = events(run_dir, "checkpoint_waited")
    assert waited["step"] == 6 and waited["interval_steps"] == 3 and waited["write_s"] >= 1.5
    assert waited["smallest_interval"] > 3
    warnings = [line for line in proc.output().splitlines() if "waited" in line and line.startswith("warning:")]
    assert len(warnings) == 1 and f"checkpoint.interval to at least {waited['smallest_interval']}," in warnings[0]
    check_ok(run_train(run_dir, DRILL))
    assert loss_trail(run_dir) == baseline[1]


def test_the_interval_advice_names_the_write_and_the_interval_that_fits():
    """The H200's case: the whole 1.8B (24.4 GiB) at ~1 GB/s, a save every 6 steps of 1.4 s."""
    from llmjp_ds.checkpoint.async_save import interval_advice, smallest_interval

    assert smallest_interval(26.0, 1.4) == 19 and smallest_interval(0.5, 1.4) == 1 and smallest_interval(2.8, 1.4) == 2
    line = interval_advice(24.4, 26.0, 6, 1.4)
    assert "24.40 GiB at 1.01 GB/s in 26.0 s" in line and "checkpoint.interval=6 steps (8.4 s at 1.40 s a step)" in line
    assert line.endswith("set checkpoint.interval to at least 19, or write the run directory to a faster disk")


def test_the_advice_of_a_save_that_barely_waited_agrees_with_itself():
    """What the trainer measured: the previous save (its snapshot, then its write of 1.5 s) ended 0.004 s into the
    next save, two steps of 0.8 s after it began. The wait was short, but the advice must still agree with the
    numbers it shows: the save took longer than the interval, so the interval it names is longer than this one."""
    from llmjp_ds.checkpoint.async_save import interval_advice

    line = interval_advice(0.01, 1.5, 2, 0.8, busy_s=1.604)
    assert "in 1.5 s, and that save took 1.604 s from its start to its write's end, longer than " \
        "checkpoint.interval=2 steps (1.600 s at 0.80 s a step)" in line, line
    assert "set checkpoint.interval to at least 3," in line


def test_a_snapshot_is_not_changed_by_the_next_step():
    """In-process: what the writer gets is a copy (containers rebuilt, tensors cloned or copied to host memory)."""
    from collections import OrderedDict

    from llmjp_ds.checkpoint.async_save import nbytes, snapshot

    w = torch.ones(4)
    state = {"module": OrderedDict(w=w, view=w[1:3]), "step": 3, "groups": [{"lr": 0.1, "p": [w]}]}
    copy = snapshot(state, pinned=False)
    w.add_(1)
    state["groups"][0]["lr"] = 0.2
    assert torch.equal(copy["module"]["w"], torch.ones(4)) and torch.equal(copy["module"]["view"], torch.ones(2))
    assert copy["groups"][0]["lr"] == 0.1 and isinstance(copy["module"], OrderedDict)
    assert nbytes(copy) == (4 + 2 + 4) * 4


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"module": {"w": torch.randn(300, 7, generator=g).bfloat16(), "b": torch.randn(5, generator=g)},
            "optimizer": {"exp_avg": torch.randn(1000, generator=g), "empty": torch.zeros(0), "step": 4}}


def _saved_bytes(state, where) -> bytes:
    """torch.save's bytes (the archive records the file's name: one name for all)."""
    where.mkdir()
    torch.save(state, where / "state.pt")
    return (where / "state.pt").read_bytes()


def test_arena_snapshots_save_the_same_bytes_and_are_reused(tmp_path):
    """Tensors cut from the arena serialise exactly as plainly copied ones (each owns only its slice: a shared
    storage would write the whole arena with every tensor), and the next save reuses the same memory."""
    from llmjp_ds.checkpoint.async_save import PinnedArena, nbytes, snapshot

    first, second = _state(0), _state(1)
    arena = PinnedArena(nbytes(first) + 8 * PinnedArena.ALIGN, pin=False)
    copy = snapshot(first, pinned=False, arena=arena)
    assert arena.used >= nbytes(first)
    assert _saved_bytes(copy, tmp_path / "a") == _saved_bytes(snapshot(first, pinned=False), tmp_path / "b")
    used = arena.used
    arena.reset()
    again = snapshot(second, pinned=False, arena=arena)
    assert arena.used == used  # the same bytes again, not more
    assert again["module"]["w"].data_ptr() == copy["module"]["w"].data_ptr()
    _saved_bytes(again, tmp_path / "c")
    loaded = torch.load(tmp_path / "c" / "state.pt", weights_only=True)
    assert torch.equal(loaded["module"]["w"], second["module"]["w"]) and loaded["optimizer"]["step"] == 4


def test_a_snapshot_larger_than_the_arena_takes_fresh_memory_for_the_rest(tmp_path):
    from llmjp_ds.checkpoint.async_save import PinnedArena, snapshot

    state = _state(2)
    arena = PinnedArena(300 * 7 * 2, pin=False)  # room for the first tensor only
    copy = snapshot(state, pinned=False, arena=arena)
    state["optimizer"]["exp_avg"].add_(1)
    assert torch.equal(copy["module"]["w"], _state(2)["module"]["w"])
    assert torch.equal(copy["optimizer"]["exp_avg"], _state(2)["optimizer"]["exp_avg"])
    assert _saved_bytes(copy, tmp_path / "a") == _saved_bytes(_state(2), tmp_path / "b")

