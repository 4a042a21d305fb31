"""The one way the suites start a training (or any CLI) as a subprocess, as a user or a scheduler would.

* :func:`subprocess_env`: the environment of a lone process (no launcher variables: the trainer picks a free
  rendezvous port, where colleagues' jobs may hold 29500), quiet wandb and tokenizers, one OpenMP thread;
* :func:`train_argv`: ``python -m llmjp_ds.train`` (one process) or ``python -m torch.distributed.run
  --nproc_per_node=N -m llmjp_ds.train``, with ``--set`` values;
* :func:`run`: run to the end, output captured (the reliability tests read it);
* :func:`run_command`: run to the end in a session of its own, output to log files, the test failed with the
  stderr tail on a non-zero exit or a timeout (every process it started is killed then); ``nproc`` > 1 starts
  that many ranks of a ``python -m llmjp_ds.train`` command.

Commands of this repository's entry points are forked from a server that has imported the trainer's stack once
(:mod:`tests.forkserver`), saving ~6 s of start-up per process; ``LLMJP_DS_TEST_FORKSERVER=0`` starts each in a
fresh interpreter instead, ranks through torchrun.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import forkserver

REPO = Path(__file__).resolve().parents[1]
CLI_TIMEOUT = 300
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def subprocess_env(**extra) -> dict:
    env = dict(os.environ)
    for key in LAUNCHER_VARS:
        env.pop(key, None)  # a test process that set these for in-process runs must not leak them
    # one OpenMP thread per process (LLMJP_DS_TEST_THREADS: another count, to measure its effect on fp32 sums)
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("LLMJP_DS_TEST_THREADS", "1"),
               WANDB_SILENT="true", TOKENIZERS_PARALLELISM="false")
    env.pop("LLMJP_DS_DEBUG", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, port: int | str) -> list[str]:
    """``python -m torch.distributed.run`` starting ``nproc`` workers on this machine, its store on ``port``."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port}"]


def train_argv(run_dir, sets=(), *more: str, nproc: int = 1, port: int | str | None = None) -> list[str]:
    """The command that trains into ``run_dir`` with ``--set`` values ``sets`` then ``more`` (``nproc`` > 1:
    through torchrun, on ``port``)."""
    if nproc == 1:
        argv = [sys.executable, "-m", "llmjp_ds.train"]
    else:
        argv = [*torchrun(nproc, port or free_port()), "-m", "llmjp_ds.train"]
    for value in (f"run_dir={run_dir}", *sets, *more):
        argv += ["--set", value]
    return argv


def run(argv, timeout: float = 240, env=None, cwd=REPO) -> subprocess.CompletedProcess:
    """Run ``argv`` to its end (from the repository root), its output captured (``subprocess.run``'s
    ``TimeoutExpired`` on a timeout, everything it started killed)."""
    import tempfile

    with tempfile.TemporaryFile("w+") as fo, tempfile.TemporaryFile("w+") as fe:
        proc = forkserver.popen(argv, env=env or subprocess_env(), cwd=cwd, stdout=fo, stderr=fe)
        try:
            proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                kill_tree(proc)
        fo.seek(0)
        fe.seek(0)
        return subprocess.CompletedProcess(list(map(str, argv)), proc.returncode, fo.read(), fe.read())


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def kill_tree(proc) -> None:
    """SIGKILL what we launched: torchrun's workers run in sessions of their own, so kill each child's process
    group, then the launcher's (each rank's, for :class:`tests.forkserver.Ranks`)."""
    for one in getattr(proc, "procs", [proc]):
        for child in _children(one.pid):
            for kill in (os.killpg, os.kill):
                try:
                    kill(child, signal.SIGKILL)
                    break
                except (ProcessLookupError, PermissionError):
                    continue
        try:
            os.killpg(one.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def tail(path: Path, chars: int = 4000) -> str:
    text = path.read_text(errors="replace") if path.is_file() else ""
    return text[-chars:]


def start_ranks(cmd: list[str], nproc: int, port: int, *, env: dict, stdout, stderr):
    """``nproc`` ranks of ``cmd`` (``python -m llmjp_ds.train ...``): forked with torchrun's variables, or,
    without the fork server, through torchrun itself."""
    if forkserver.server_path() is not None:
        return forkserver.Ranks(cmd, nproc, port, env=env, stdout=stdout, stderr=stderr)
    return forkserver.popen([*torchrun(nproc, port), *cmd[1:]], env=env, stdout=stdout, stderr=stderr)


def run_command(cmd: list[str], log_prefix: Path, *, env: dict | None = None, timeout: float = CLI_TIMEOUT,
                check: bool = True, nproc: int = 1, port: int | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in a session of its own (``nproc`` > 1: that many ranks of it on ``port``), stdout/stderr to
    ``<log_prefix>.out/.err``; kill everything it started on timeout. ``check``: fail the test (with the
    stderr tail) on a non-zero exit."""
    out, err = log_prefix.with_suffix(".out"), log_prefix.with_suffix(".err")
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    env = env or subprocess_env()
    with open(out, "w") as fo, open(err, "w") as fe:
        if nproc > 1:
            proc = start_ranks(cmd, nproc, port or free_port(), env=env, stdout=fo, stderr=fe)
        else:
            proc = forkserver.popen(cmd, env=env, stdout=fo, stderr=fe)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\n--- stderr tail ---\n{tail(err)}\n"
                        f"--- stdout tail ---\n{tail(out, 2000)}", pytrace=False)
        finally:
            if proc.poll() is None:  # interrupted (pytest-timeout, Ctrl-C): leave nothing running
                kill_tree(proc)
    result = subprocess.CompletedProcess(cmd, proc.returncode, out.read_text(errors="replace"),
                                         err.read_text(errors="replace"))
    result.wall_s = time.monotonic() - t0
    if check and proc.returncode != 0:
        pytest.fail(f"exit code {proc.returncode}: {' '.join(cmd)}\n--- stderr tail ---\n{tail(err)}\n"
                    f"--- stdout tail ---\n{tail(out, 2000)}", pytrace=False)
    return result
