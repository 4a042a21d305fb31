"""Two ``python -m llmjp_ds.train`` processes started as ``srun -n 2`` (or ``mpirun -np 2``) starts them, with only
the scheduler's variables and no torchrun ones: they must train as one world of two ranks, to the bit the suite's
two-process run of the same config (``runs.full("zero1")``, ranks given torchrun's variables by tests/runs.py:
same process count, same code path). Two lone trainings instead would collide on the run directory's lock."""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from deepspeed.accelerator import get_accelerator

from llmjp_ds.parallel.context import use_the_environments_ninja
from tests import forkserver
from tests.launch import REPO, free_port, kill_tree, subprocess_env, tail, train_argv
from tests.runs import COMMON_SETS, LAYOUTS, STEPS, TRAIN_TIMEOUT, trail

pytestmark = pytest.mark.slow

SETS = (*COMMON_SETS, *LAYOUTS["zero1"][1], f"train.steps={STEPS}")  # what runs.full("zero1") trains
COMPARED = ("loss", "grad_norm", "lr", "consumed_samples")
FOREIGN = ("SLURM_", "OMPI_", "PMI_", "MPI_LOCAL", "TORCHELASTIC_", "GROUP_", "CROSS_", "PE_HOSTFILE", "PBS_",
           "LOCAL_SIZE", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "LLMJP_DS_SOCKET_IFNAME")


def _clean_env(**extra) -> dict:
    """A lone process's environment (tests/launch.py), without any launcher's or scheduler's variables."""
    env = {k: v for k, v in subprocess_env().items() if not k.startswith(FOREIGN)}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _loopback_host() -> str:
    """This host's short name when /etc/hosts maps it to a loopback address (as a Slurm nodelist names hosts),
    else ``localhost``; read from the file, so no name is looked up."""
    name = socket.gethostname().split(".")[0]
    try:
        lines = Path("/etc/hosts").read_text().splitlines()
    except OSError:
        return "localhost"
    for line in lines:
        fields = line.split("#")[0].split()
        if len(fields) > 1 and name in fields[1:]:
            try:
                return name if ipaddress.ip_address(fields[0]).is_loopback else "localhost"
            except ValueError:
                continue
    return "localhost"


def _run_ranks(envs: list[dict], run_dir: Path, logs: Path, timeout: float = TRAIN_TIMEOUT) -> None:
    """Start one training per environment (the same command), wait for all; fail with their stderr tails."""
    logs.mkdir(parents=True, exist_ok=True)
    procs, files = [], []
    for rank, env in enumerate(envs):
        out, err = open(logs / f"rank{rank}.out", "w"), open(logs / f"rank{rank}.err", "w")
        files += [out, err]
        procs.append(forkserver.popen(train_argv(run_dir, SETS), stdout=out, stderr=err, env=env, cwd=REPO))
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc)
        for f in files:
            f.close()
    report = "\n".join(f"--- rank {r} (exit {p.returncode}) ---\n{tail(logs / f'rank{r}.err', 3000)}"
                       for r, p in enumerate(procs))
    assert all(p.returncode == 0 for p in procs), report


def _same_trail(run_dir: Path, reference: Path) -> None:
    got, ref = trail(run_dir), trail(reference)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [[r[k] for k in COMPARED] for r in got] == [[r[k] for k in COMPARED] for r in ref]


def _slurm_port_and_job() -> tuple[int, int]:
    """A free port and a job id that LLM-jp's rule (10000 + id % 50000) maps to it."""
    for _ in range(100):
        port = free_port()
        if 10000 <= port < 60000:
            return port, port - 10000 + 50000 * 123
    pytest.skip("no free port in 10000-59999")


@pytest.mark.timeout(900)
def test_srun_style_environment_trains_one_world(runs, tmp_path):
    reference = runs.full("zero1")
    port, job_id = _slurm_port_and_job()
    host = _loopback_host()
    step = dict(SLURM_JOB_ID=job_id, SLURM_JOBID=job_id, SLURM_STEP_ID=0, SLURM_NTASKS=2, SLURM_NNODES=1,
                SLURM_JOB_NODELIST=host, SLURM_NTASKS_PER_NODE=2, SLURM_NODEID=0)
    envs = [_clean_env(**step, SLURM_PROCID=rank, SLURM_LOCALID=rank) for rank in (0, 1)]
    run_dir = tmp_path / "run"
    _run_ranks(envs, run_dir, tmp_path / "logs")
    out = (tmp_path / "logs" / "rank0.out").read_text()
    assert f"[llmjp-ds] launch: slurm, world 2, nodes 1, master {host}:{port}" in out
    _same_trail(run_dir, reference)


@pytest.mark.timeout(900)
def test_mpirun_trains_one_world(runs, tmp_path, monkeypatch):
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("no mpirun on this machine (Open MPI is not installed)")
    reference = runs.full("zero1")
    port = free_port()
    run_dir = tmp_path / "run"
    argv = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", "-bind-to", "none",
            "-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={port}", *train_argv(run_dir, SETS)]
    env = _clean_env(OMPI_ALLOW_RUN_AS_ROOT=1, OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)
    # mpirun started by its full path puts its own bin/ first on the ranks' PATH, where a system ninja may be: the
    # ranks still build DeepSpeed's op with the venv's, so the op built here (as a rank of any launcher builds it)
    # stays as it is; PATH, which that call may change, is this worker's again after the test
    monkeypatch.setenv("PATH", os.environ.get("PATH", ""))
    use_the_environments_ninja()
    get_accelerator().create_op_builder("ShareMemCommBuilder").load(verbose=False)
    built = Path(env["TORCH_EXTENSIONS_DIR"]) / "deepspeed_shm_comm" / ".ninja_log"
    before = built.read_text()
    done = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=TRAIN_TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"[llmjp-ds] launch: openmpi, world 2, nodes 1, master 127.0.0.1:{port}" in done.stdout
    _same_trail(run_dir, reference)
    assert built.read_text() == before, "the ranks under mpirun rebuilt DeepSpeed's op with another ninja"
