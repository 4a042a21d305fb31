"""A launcher that goes away takes its trainer with it, cleanly: the trainer saves at the step boundary and exits 0
exactly as on its own SIGTERM, no process of the job is left, and a relaunch (on the same port) resumes exactly.

Real launchers on CPU: DeepSpeed's (``deepspeed --num_accelerators 1``: runner -> ``deepspeed.launcher.launch``
-> the rank; with a hostfile too) and torchrun. A SIGTERM to the DeepSpeed runner's pid alone ends the runner
at once and reaches nobody else; a scheduler's SIGTERM to the process group reaches all three, and launch then
forwards another SIGTERM to the rank (SIGKILL 30 s later): one save, not one per signal. torchrun's agent
forwards SIGTERM to its workers; a SIGKILL of the agent leaves them alone, and the rank's launcher watcher
(``llmjp_ds.launch.launcher``) must notice. A port in use is one line naming the port and its holder.

The DeepSpeed launcher on CPU leaves ``/dev/shm/deepspeed_allreduce_buffer_<rank>_<addr>_<port>_*`` (69 MB)
behind: each test removes those of the ports it used.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from tests.launch import free_port
from tests.reliability.conftest import (
    DRILL_STEPS, TINY, Proc, assert_latest_complete, events, latest_of, loss_trail, run, subprocess_env, tag_step,
    train_argv, wait_for,
)

pytestmark = pytest.mark.slow

SETS = [*TINY, f"train.steps={DRILL_STEPS}", "checkpoint.interval=0"]  # the baseline's schedule; saves: signals
ENDS_WITHIN = 25  # s from the signal to the trainer gone: under DeepSpeed's launch, less than its 30 s SIGKILL


@pytest.fixture
def ports():
    """Ports for the test's deepspeed jobs; their shared-memory buffers are removed afterwards."""
    used: list[int] = []
    yield used
    for port in used:
        for leftover in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_127.0.0.1_{port}_*"):
            leftover.unlink(missing_ok=True)


def deepspeed_argv(run_dir, port: int, *sets: str, hostfile: Path | None = None) -> list[str]:
    argv = [str(Path(sys.executable).parent / "deepspeed")]
    if hostfile is not None:
        argv += ["--hostfile", str(hostfile), "--no_ssh_check", "--master_addr", "127.0.0.1"]
    else:
        argv += ["--num_accelerators", "1"]
    argv += ["--master_port", str(port), "llmjp_ds/train.py", "--set", f"run_dir={run_dir}"]
    for s in (*SETS, *sets):
        argv += ["--set", s]
    return argv


def torchrun_argv(run_dir, *sets: str) -> list[str]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", f"--master_port={free_port()}",
            "-m", "llmjp_ds.train", "--set", f"run_dir={run_dir}"]
    for s in (*SETS, *sets):
        argv += ["--set", s]
    return argv


# --- the processes of a job, from /proc ----------------------------------------------------------------------

def _stat(pid: int) -> tuple[str, int] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return fields[0], int(fields[1])


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) and st[1] == pid and st[0] not in "ZX":
            out.append(int(entry.name))
    return out


def gone(pid: int) -> bool:
    st = _stat(pid)
    return st is None or st[0] in "ZX"


def the_child(pid: int) -> int:
    found = wait_for(lambda: children(pid), timeout=30, interval=0.05)
    assert found and len(found) == 1, (pid, found)
    return found[0]


def start(argv) -> Proc:
    proc = Proc(argv)
    assert wait_for(lambda: proc.steps_done() >= 3, proc, timeout=180), proc.output()[-3000:]
    return proc


def ends(pids: list[int], sent: float, proc: Proc) -> float:
    """Wait until every pid in ``pids`` is gone; the seconds since ``sent`` it took."""
    assert wait_for(lambda: all(map(gone, pids)), timeout=ENDS_WITHIN + 30, interval=0.05), (
        [p for p in pids if not gone(p)], proc.output()[-3000:])
    took = time.monotonic() - sent
    proc.wait(30)  # the runner or agent (the pipe's last writers are gone now)
    return took


def check_one_save(run_dir, before: str | None, output: str) -> int:
    """Exactly one checkpoint since ``before``, at the step the run last logged, with its ``preempted`` event;
    the rank's own success line (it printed `done`: its exit code is 0)."""
    tag = assert_latest_complete(run_dir)
    assert tag is not None and tag != before, (before, tag, output[-3000:])
    step = tag_step(tag)
    assert step == max(loss_trail(run_dir)), (tag, loss_trail(run_dir))
    done = [e for e in events(run_dir, "preempted") if before is None or e["step"] > tag_step(before)]
    assert [e["tag"] for e in done] == [tag], done
    ckpts = sorted(p.name for p in (Path(run_dir) / "checkpoints").glob("step*"))
    assert ckpts == sorted({*([before] if before else []), tag}), ckpts
    assert f"[llmjp-ds] done: step {step}," in output, output[-3000:]
    return step


@pytest.mark.timeout(420)
def test_deepspeed_launcher_gone_or_signalled_the_rank_saves_once_and_ends(baseline, tmp_path, ports):
    """1. SIGTERM to the runner's pid alone (launch and the rank get nothing): the rank notices the runner gone,
    saves, exits 0 (launch says so), nothing is left. 2. With a hostfile, a scheduler's SIGTERM to the whole
    process group (runner, launch, rank; then launch's own SIGTERM): one save, well before launch's SIGKILL.
    3. A relaunch on the first job's port resumes and logs the uninterrupted run's losses."""
    _, expected = baseline
    run_dir = tmp_path / "run"
    ports.append(free_port())

    proc = start(deepspeed_argv(run_dir, ports[0]))
    launch = the_child(proc.p.pid)
    rank = the_child(launch)
    sent = time.monotonic()
    os.kill(proc.p.pid, signal.SIGTERM)  # the runner alone
    took = ends([launch, rank], sent, proc)
    assert took < ENDS_WITHIN, f"the rank ended {took:.1f} s after its launcher"
    out = proc.output()
    assert f"[llmjp-ds] [rank 0] the deepspeed runner (pid {proc.p.pid}) is gone" in out, out[-3000:]
    assert f"Process {rank} exits successfully." in out, out[-3000:]  # launch saw the rank exit 0
    first = check_one_save(run_dir, None, out)

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n")
    ports.append(free_port())
    proc = start(deepspeed_argv(run_dir, ports[1], hostfile=hostfile))
    launch = the_child(proc.p.pid)
    rank = the_child(launch)
    sent = time.monotonic()
    proc.signal(signal.SIGTERM)  # os.killpg: the job's process group, as a scheduler does
    took = ends([launch, rank], sent, proc)
    assert took < ENDS_WITHIN, f"the rank ended {took:.1f} s after the signal (launch kills at 30 s)"
    out = proc.output()
    assert events(run_dir, "resume")[-1]["tag"] == f"step{first:08d}", events(run_dir, "resume")
    second = check_one_save(run_dir, f"step{first:08d}", out)
    assert second > first

    proc = Proc(deepspeed_argv(run_dir, ports[0]))  # the first job's port: nothing holds it
    assert proc.wait(240) == 0, proc.output()[-3000:]
    assert latest_of(run_dir) == f"step{DRILL_STEPS:08d}"
    assert loss_trail(run_dir) == expected


@pytest.mark.timeout(420)
def test_torchrun_agent_signalled_or_killed_the_rank_saves_and_ends(baseline, tmp_path):
    """SIGTERM to torchrun's agent alone (it forwards SIGTERM to its worker): one save, exit 0. SIGKILL of the
    agent (nothing forwarded): the worker notices its parent gone, saves, ends. The run then resumes exactly."""
    _, expected = baseline
    run_dir = tmp_path / "run"
    before = None
    for sig in (signal.SIGTERM, signal.SIGKILL):
        proc = start(torchrun_argv(run_dir))
        rank = the_child(proc.p.pid)
        sent = time.monotonic()
        os.kill(proc.p.pid, sig)  # the agent alone
        took = ends([rank], sent, proc)
        assert took < ENDS_WITHIN, f"{sig.name}: the rank ended {took:.1f} s after the signal"
        out = proc.output()
        if sig == signal.SIGKILL:
            assert f"[llmjp-ds] [rank 0] the torchrun (pid {proc.p.pid}) is gone" in out, out[-3000:]
        step = check_one_save(run_dir, before, out)
        before = f"step{step:08d}"
    result = run(train_argv(run_dir, SETS))
    assert result.returncode == 0, result.stderr[-3000:]
    assert loss_trail(run_dir) == expected


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launch", ["torchrun", "srun"])
def test_a_port_in_use_is_one_line_naming_it_and_its_holder(bundled, tmp_path, launch):
    """A stale process holds the rendezvous port: the relaunch ends with one line (the port, the host, the
    holder's pid and command line, how to choose another), no traceback, and writes nothing. ``srun``: rank 0 of
    a Slurm step of two tasks, which serves the store itself, refuses before waiting for the other."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        if launch == "torchrun":
            env = subprocess_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=0, WORLD_SIZE=1, LOCAL_RANK=0)
        else:
            env = subprocess_env(SLURM_JOB_ID=4242, SLURM_STEP_ID=0, SLURM_NTASKS=2, SLURM_PROCID=0, SLURM_LOCALID=0,
                                 SLURM_NODEID=0, SLURM_JOB_NODELIST="localhost", SLURM_NTASKS_PER_NODE=2,
                                 MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        result = run(train_argv(tmp_path / "run", TINY, "train.steps=2"), env=env, timeout=100)
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(f"error: the rendezvous port {port} on 127.0.0.1 ("), lines
    assert f"held by pid {os.getpid()} (" in lines[0] and f"kill {os.getpid()}" in lines[0], lines
    assert "--master_port" in lines[0] and "--master-port" in lines[0], lines
    assert "Traceback" not in result.stdout + result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
