"""On the CPU DeepSpeed compiles its shared-memory op at the first run, under a lock file of torch's JIT build; a
build interrupted (Ctrl-C, a killed job) leaves the lock, and every later run would wait on it forever without a
word. A run refuses a stale lock with one line and names a fresh one in a warning, and never removes it
(``llmjp_ds.parallel.context.check_build_lock``). The build runs the environment's own ninja, whatever PATH a
launcher gave (``use_the_environments_ninja``; tests/parallel/test_scheduler_launch.py checks it under mpirun)."""

from __future__ import annotations

import os
import shutil
import sys
import time

import pytest

from llmjp_ds.parallel.context import check_build_lock, use_the_environments_ninja

from tests.reliability.conftest import TINY, run, subprocess_env, train_argv


def plant(extensions, age_s: float):
    lock = extensions / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)  # check_build_lock makes it, as torch does
    lock.touch()
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


@pytest.mark.timeout(150)
def test_a_run_refuses_a_stale_build_lock_in_one_line(bundled, tmp_path):
    lock = plant(tmp_path / "extensions", 2 * 3600)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    result = run(train_argv(tmp_path / "run", TINY, "train.steps=1"), timeout=120,
                 env=subprocess_env(TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions")))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {lock} is left from a build of DeepSpeed's deepspeed_shm_comm op interrupted 120 min ago, and this "
        "run would wait on it forever: if no other run is building it, remove that file and start again")
    # nothing written or removed: the lock stays (it is torch's), and the refused run leaves no run directory
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert not (tmp_path / "run").exists()


def test_a_lock_of_a_build_in_progress_gets_a_warning(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "0")
    check_build_lock()  # no lock: nothing to say
    assert capsys.readouterr().out == ""
    lock = plant(tmp_path, 30)
    check_build_lock()
    out = capsys.readouterr().out
    assert out.startswith(f"warning: waiting on {lock}: a build of DeepSpeed's deepspeed_shm_comm op started 3"), out
    monkeypatch.setenv("LOCAL_RANK", "1")  # one line per node
    check_build_lock()
    assert capsys.readouterr().out == "" and lock.is_file()


def test_the_build_runs_the_ninja_beside_the_interpreter_whatever_path_the_launcher_gave(tmp_path, monkeypatch):
    def ninja(bin_dir):
        bin_dir.mkdir(parents=True)
        (bin_dir / "ninja").write_text("#!/bin/sh\nexit 1\n")  # never run: only found
        (bin_dir / "ninja").chmod(0o755)
        return bin_dir / "ninja"

    own, launchers = ninja(tmp_path / "venv" / "bin"), ninja(tmp_path / "usr" / "bin")
    monkeypatch.setattr(sys, "executable", str(own.parent / "python"))
    monkeypatch.setenv("PATH", f"{launchers.parent}{os.pathsep}{own.parent}")  # as /usr/bin/mpirun gives its ranks
    use_the_environments_ninja()
    assert shutil.which("ninja") == str(own)
    use_the_environments_ninja()  # first already: PATH stays as it is
    assert os.environ["PATH"] == f"{own.parent}{os.pathsep}{launchers.parent}{os.pathsep}{own.parent}"
    # an interpreter without a ninja of its own (a system Python): PATH is the launcher's
    own.unlink()
    monkeypatch.setenv("PATH", str(launchers.parent))
    use_the_environments_ninja()
    assert os.environ["PATH"] == str(launchers.parent)
