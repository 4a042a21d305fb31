"""Training across two real hosts, made of network namespaces on this machine (tests/cluster.py): each has its own
address, its own name (which resolves to 127.0.1.1 on itself, as Debian writes /etc/hosts) and its own sshd.

Each way of launching runs the config of the suite's two-rank ZeRO-1 run (``runs.full("zero1")``: torchrun, two
ranks on one host) with one rank per host, and its trail must equal that run's to the bit: the same two ranks
reduce the same numbers in the same order over gloo, whichever host each rank is on. The batch templates (Slurm's
two, Grid Engine's) prove it in their requeue and rerun tests, whose whole trail, stopped and resumed, equals an
uninterrupted torchrun run of the same config. Then a host is taken away mid-run, by ending its processes or by
silence (its link down and its processes killed, as when it loses power): the command the user typed must end
within 60 s, non-zero, with one line naming the lost host, and the relaunch on the remaining host (one rank, the
same global batch) resumes from the latest checkpoint through the reshape. The hosts' ssh has no keepalive, as a
user's has not: a session to a silent host ends only when something ends it.

The hosts, and the Slurm and the Grid Engine on them, are made once for the session (tests/cluster.py) and reset
before each test.
The long runs notice a lost host after ``parallel.heartbeat_timeout_s`` of 10 s (30 by default): what the tests
assert (the line, the end within 60 s, the resume) does not depend on it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import cluster
from tests.launch import REPO, free_port, tail
from tests.parallel.test_scheduler_launch import SETS, _clean_env, _same_trail
from tests.runs import COMMON_SETS, LAYOUTS, trail

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
CARRIED = ("LLMJP_DS_CACHE", "TORCH_EXTENSIONS_DIR")
LOST_WITHIN_S = 60
_LOST = {"power": "gone silent", "end": "killed"}  # how node2 was taken away, as the tests print it
RANK_ON_DEEPSPEED = r"llmjp_ds/train\.py --local_rank"  # a rank's command line under DeepSpeed's launch
RANK_OF_TEMPLATE = r"^\S*python\S* -m llmjp_ds\.train"  # a rank of the batch templates (not srun or mpirun)
RANK_ON_TORCHRUN = r"^\S*python\S* -u -m llmjp_ds\.train"  # a worker of torchrun (not torchrun itself)
HEARTBEAT_S = 10
LONG = (*COMMON_SETS, *LAYOUTS["zero1"][1], "train.steps=100000", "optim.decay_steps=100000",
        "checkpoint.interval=5", "checkpoint.keep_last=2", f"parallel.heartbeat_timeout_s={HEARTBEAT_S}")


def _sets(run_dir: Path, sets) -> list[str]:
    argv = []
    for value in (f"run_dir={run_dir}", *sets):
        argv += ["--set", value]
    return argv


def _env_file(path: Path) -> Path:
    """What the job needs on every host, in DeepSpeed's .deepspeed_env format (DS_ENV_FILE points at it): pdsh
    carries only these lines and a few prefixes of the runner's environment."""
    lines = [f"{k}={os.environ[k]}" for k in CARRIED if os.environ.get(k)]
    lines += ["OMP_NUM_THREADS=1", "WANDB_SILENT=true", "TOKENIZERS_PARALLELISM=false", "PYTHONUNBUFFERED=1"]
    # this session's PATH, not sshd's, as a user of a venv puts it in .deepspeed_env (DeepSpeed's CPU op is built
    # with the venv's ninja either way: llmjp_ds.parallel.context.use_the_environments_ninja)
    lines.append(f"PATH={BIN}:{os.environ['PATH']}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _deepspeed(hosts, tmp_path: Path, run_dir: Path, sets, slots=(1, 1), names=None, *more: str) -> list[str]:
    """``deepspeed --hostfile`` (without --master_addr the runner asks the first host for its address over ssh)."""
    names = names or hosts.nodes
    hostfile = tmp_path / f"hostfile-{len(names)}"
    hostfile.write_text("".join(f"{n} slots={s}\n" for n, s in zip(names, slots)))
    return [str(BIN / "deepspeed"), "--hostfile", str(hostfile), "--master_port", str(free_port()), *more,
            "llmjp_ds/train.py", *_sets(run_dir, sets)]


def _start(hosts, name: str, argv: list[str], logs: Path, env: dict) -> subprocess.Popen:
    logs.parent.mkdir(parents=True, exist_ok=True)
    out = open(logs.with_suffix(".out"), "w")
    proc = hosts.popen(name, argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    out.close()
    return proc


def _finish(proc: subprocess.Popen, logs: Path, timeout: float, what: str = "") -> str:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"{what or 'the command'} still ran {timeout:.0f} s later\n{tail(logs.with_suffix('.out'))}",
                    pytrace=False)
    return logs.with_suffix(".out").read_text(errors="replace")


def _ds_env(tmp_path: Path) -> dict:
    return _clean_env(DS_ENV_FILE=_env_file(tmp_path / "deepspeed_env"))


@pytest.mark.timeout(600)
def test_deepspeed_hostfile_trains_one_world_across_two_hosts(runs, hosts, tmp_path):
    reference = runs.full("zero1")
    run_dir = tmp_path / "run"
    logs = tmp_path / "logs" / "deepspeed"
    proc = _start(hosts, "node1", _deepspeed(hosts, tmp_path, run_dir, SETS), logs, _ds_env(tmp_path))
    out = _finish(proc, logs, 300)
    assert proc.returncode == 0, out[-4000:]
    assert "node1: " in out and "node2: " in out  # pdsh's prefix: the ranks ran on both hosts
    _same_trail(run_dir, reference)


@pytest.mark.timeout(600)
def test_mpirun_trains_one_world_across_two_hosts(runs, hosts, tmp_path):
    if cluster.missing("mpirun"):
        pytest.skip(cluster.missing("mpirun"))
    reference = runs.full("zero1")
    run_dir = tmp_path / "run"
    logs = tmp_path / "logs" / "mpirun"
    env = _clean_env(OMPI_ALLOW_RUN_AS_ROOT=1, OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1, OMP_NUM_THREADS=1)
    exports = [a for k in (*CARRIED, "OMP_NUM_THREADS", "PATH") if k in env for a in ("-x", k)]
    argv = ["mpirun", "-H", "node1:1,node2:1", "-np", "2", "-bind-to", "none", "-map-by", "slot",
            "-x", "MASTER_ADDR=node1", "-x", f"MASTER_PORT={free_port()}", *exports,
            sys.executable, "-m", "llmjp_ds.train", *_sets(run_dir, SETS)]
    proc = _start(hosts, "node1", argv, logs, env)
    out = _finish(proc, logs, 300)
    assert proc.returncode == 0, out[-4000:]
    _same_trail(run_dir, reference)


@pytest.mark.timeout(600)
def test_torchrun_on_each_host_trains_one_world_across_two_hosts(runs, hosts, tmp_path):
    """``torchrun --nnodes=2`` started on each host (c10d rendezvous at node1), as a cluster without pdsh runs it."""
    reference = runs.full("zero1")
    run_dir = tmp_path / "run"
    procs = _torchrun_on_both(hosts, tmp_path, run_dir, SETS)
    outs = {name: _finish(proc, tmp_path / "logs" / f"torchrun-{name}", 300) for name, proc in procs.items()}
    assert all(proc.returncode == 0 for proc in procs.values()), "\n".join(o[-3000:] for o in outs.values())
    _same_trail(run_dir, reference)


def _torchrun(run_dir: Path, sets, nnodes: int, port: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", "--nproc-per-node=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=node1:{port}", "--rdzv-id=llmjp-ds", "-m", "llmjp_ds.train",
            *_sets(run_dir, sets)]


def _torchrun_on_both(hosts, tmp_path: Path, run_dir: Path, sets) -> dict[str, subprocess.Popen]:
    port = free_port()
    return {name: _start(hosts, name, _torchrun(run_dir, sets, 2, port), tmp_path / "logs" / f"torchrun-{name}",
                         _clean_env()) for name in hosts.nodes}


def _wait_for(what: str, done, timeout: float, say) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"no {what} after {timeout:.0f} s\n{say()}"
        time.sleep(0.5)


def _wait_for_checkpoint(run_dir: Path, proc: subprocess.Popen, logs: Path, timeout: float = 180) -> str:
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + timeout
    while not latest.is_file():
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no checkpoint (exit {proc.poll()})\n{tail(logs.with_suffix('.out'))}", pytrace=False)
        time.sleep(0.5)
    return latest.read_text().strip()


def _lose_a_host(hosts, tmp_path: Path, how: str) -> tuple[Path, float, str, int]:
    """Start the long run on both hosts with ``deepspeed --hostfile`` from node1, take node2 away after its first
    checkpoint (``how``: ``power`` off, or ``end`` its job's processes); (run_dir, seconds from the loss to the
    end of the deepspeed command, its output, its exit status)."""
    run_dir = tmp_path / "run"
    logs = tmp_path / "logs" / f"lost-{how}"
    proc = _start(hosts, "node1", _deepspeed(hosts, tmp_path, run_dir, LONG), logs, _ds_env(tmp_path))
    _wait_for_checkpoint(run_dir, proc, logs)
    t0 = time.monotonic()
    if how == "power":
        assert hosts.power_off("node2")
    else:
        assert hosts.end_processes("node2", "llmjp_ds/train.py")  # the launch and its rank
    out = _finish(proc, logs, LOST_WITHIN_S + 15, f"the deepspeed command (node2 {_LOST[how]})")
    took = time.monotonic() - t0
    print(f"deepspeed --hostfile, node2 {_LOST[how]}: the deepspeed command ended {took:.1f} s later, "
          f"status {proc.returncode}")
    return run_dir, took, out, proc.returncode


def _our_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if re.match(r"^(node\d: )?error: ", line)]


def _ended_in_one_line(out: str, took: float, expected: str) -> None:
    """Within :data:`LOST_WITHIN_S` of the loss, with one line of ours, holding ``expected``."""
    assert took < LOST_WITHIN_S, out[-3000:]
    lines = _our_lines(out)
    assert len(lines) == 1 and expected in lines[0], out[-3000:]


def _ended_naming_node2(hosts, out: str, took: float, how: str, mpirun: bool = False) -> None:
    """:func:`_ended_in_one_line` with the heartbeat's line (``power``) or the closed connection's (``end``); a rank
    killed under mpirun is mpirun's to report (its daemon tells it first), which may end rank 0 before its line."""
    addr = hosts.addr["node2"]
    if how == "power":
        _ended_in_one_line(out, took, f"rank 1 on node2 ({addr}) has sent no heartbeat")
    elif not mpirun:
        _ended_in_one_line(out, took, f"the connection to node2 ({addr}, rank 1) closed")
    else:
        assert took < LOST_WITHIN_S and len(_our_lines(out)) <= 1, out[-3000:]
        assert "on node node2 exited on signal 9" in out, out[-3000:]


def _relaunch_on_node1(hosts, tmp_path: Path, run_dir: Path, launcher: str = "deepspeed") -> None:
    """The same config on node1 alone (one rank: the reshape resumes the two-rank checkpoint) with the same
    launcher (torchrun: ``--nnodes=1``), stopped by SIGTERM once it has saved again; its first step follows the
    latest checkpoint's and the samples continue."""
    tag = (run_dir / "checkpoints" / "latest").read_text().strip()
    resumed_from = int(re.search(r"\d+", tag).group())
    before = [r for r in trail(run_dir) if r["step"] <= resumed_from]
    logs = tmp_path / "logs" / "relaunch"
    if launcher == "deepspeed":
        argv, env, rank = (_deepspeed(hosts, tmp_path, run_dir, LONG, slots=(1,), names=["node1"]), _ds_env(tmp_path),
                           RANK_ON_DEEPSPEED)
    else:
        argv, env, rank = _torchrun(run_dir, LONG, 1, free_port()), _clean_env(), RANK_ON_TORCHRUN
    proc = _start(hosts, "node1", argv, logs, env)
    deadline = time.monotonic() + 240
    while (run_dir / "checkpoints" / "latest").read_text().strip() == tag:
        assert proc.poll() is None and time.monotonic() < deadline, tail(logs.with_suffix(".out"))
        time.sleep(0.5)
    assert hosts.end_processes("node1", rank, signal.SIGTERM)  # the rank: save, exit 0
    out = _finish(proc, logs, 120)
    assert proc.returncode == 0, out[-4000:]
    after = [r for r in trail(run_dir) if r["step"] > resumed_from]
    assert after and after[0]["step"] == resumed_from + 1, out[-3000:]
    assert after[0]["consumed_samples"] == before[-1]["consumed_samples"] + 8
    from llmjp_ds.metrics.record import read_metrics

    reshapes = [r for r in read_metrics(run_dir) if r.get("event") == "reshape"]
    assert reshapes and reshapes[-1]["tag"] == tag, reshapes


@pytest.mark.timeout(600)
def test_a_host_gone_silent_ends_the_deepspeed_command_within_60s_naming_it_and_the_relaunch_resumes(
        hosts, train_env, tmp_path):
    """node2 loses power (link down, processes killed) while ssh has no keepalive: the command typed on node1
    ends, non-zero, with rank 0's line; nothing the user set made ssh give up on node2."""
    run_dir, took, out, status = _lose_a_host(hosts, tmp_path, "power")
    assert status != 0, out[-3000:]
    _ended_naming_node2(hosts, out, took, "power")
    _relaunch_on_node1(hosts, tmp_path, run_dir)


@pytest.mark.timeout(600)
def test_a_host_whose_processes_die_ends_the_job_naming_it(hosts, train_env, tmp_path):
    run_dir, took, out, status = _lose_a_host(hosts, tmp_path, "end")
    assert status != 0, out[-3000:]
    _ended_naming_node2(hosts, out, took, "end")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("how", ["end", "power"])
def test_a_host_lost_under_torchrun_ends_the_job_on_the_other_within_60s_and_a_relaunch_resumes(
        hosts, train_env, tmp_path, how):
    """torchrun on each host (node1 serves the rendezvous); node2's processes killed, or node2 powered off, after a
    checkpoint: torchrun on node1 ends, non-zero, with the one line; after the power loss ``torchrun --nnodes=1``
    on node1 resumes."""
    run_dir = tmp_path / "run"
    procs = _torchrun_on_both(hosts, tmp_path, run_dir, LONG)
    logs = tmp_path / "logs" / "torchrun-node1"
    _wait_for_checkpoint(run_dir, procs["node1"], logs)
    t0 = time.monotonic()
    if how == "power":
        assert hosts.power_off("node2")
    else:
        assert hosts.end_processes("node2", r"torch\.distributed\.run|llmjp_ds\.train")  # the agent and its worker
    out = _finish(procs["node1"], logs, LOST_WITHIN_S + 15, f"torchrun on node1 (node2 {_LOST[how]})")
    took = time.monotonic() - t0
    print(f"torchrun on each host, node2 {_LOST[how]}: torchrun on node1 ended {took:.1f} s later, "
          f"status {procs['node1'].returncode}")
    assert procs["node1"].returncode != 0, out[-3000:]
    _ended_naming_node2(hosts, out, took, how)
    if how == "power":
        _relaunch_on_node1(hosts, tmp_path, run_dir, "torchrun")


@pytest.mark.timeout(600)
def test_a_rank_that_cannot_reach_the_rendezvous_ends_the_job_naming_its_host_and_the_address(hosts, train_env,
                                                                                             tmp_path):
    """node2 resolves node1 to an address nobody holds (a stale /etc/hosts): its rank says so, and the job ends
    after parallel.rendezvous_timeout_s, with no rank left waiting."""
    stale = f"{hosts.subnet}.99"
    etc = hosts.etc("node2") / "hosts"
    etc.write_text(etc.read_text().replace(f"{hosts.addr['node1']} node1", f"{stale} node1"))
    run_dir = tmp_path / "run"
    logs = tmp_path / "logs" / "unreachable"
    timeout_s = 10
    t0 = time.monotonic()
    sets = (*SETS, f"parallel.rendezvous_timeout_s={timeout_s}")
    argv = _deepspeed(hosts, tmp_path, run_dir, sets, (1, 1), None, "--master_addr", "node1")  # a name, resolved
    proc = _start(hosts, "node1", argv, logs, _ds_env(tmp_path))  # on each host
    out = _finish(proc, logs, 180)
    took = time.monotonic() - t0
    assert proc.returncode != 0
    lines = _our_lines(out)
    node2 = [line for line in lines if line.startswith("node2: ")]
    assert len(node2) == 1, out[-3000:]
    assert f"rank 1 on node2 cannot reach the rendezvous at node1:" in node2[0] and f"({stale} there" in node2[0]
    assert "rank 1 of 2 did not reach the rendezvous" in out  # rank 0, on node1, did not wait on
    assert took < timeout_s + 60, out[-3000:]  # start-up (imports, ssh) plus the timeout
    assert not hosts.pids_of("node1", "llmjp_ds/train.py") and not hosts.pids_of("node2", "llmjp_ds/train.py")


def _sbatch(hosts, slurm, tmp_path: Path, script: str, run_dir: Path, sets, name: str):
    """``sbatch --parsable --nodes=2 --ntasks-per-node=1 --gpus-per-node=0 hostfiles/<script> --set ...`` from
    node1 (the GPU request overridden on the command line, as on a Slurm without GPUs). Not ``--wait``: sbatch
    looks at the job after 2, 4, 8, 16 and 32 s, and a job of 15 s cost a test 42 s."""
    out = tmp_path / "logs" / f"{name}-%j.out"
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = ["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1",
            "--gpus-per-node=0", f"--output={out}", f"hostfiles/{script}", *_sets(run_dir, sets)]
    env = _clean_env(SLURM_CONF=slurm.conf, PATH=f"{BIN}:{os.environ['PATH']}",  # sbatch exports it to the job
                     OMPI_ALLOW_RUN_AS_ROOT=1, OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)  # these tests run as root
    return hosts.popen("node1", argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)


def _job_output(tmp_path: Path, name: str) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((tmp_path / "logs").glob(f"{name}-*.out")))


def _job_id(proc: subprocess.Popen) -> str:
    said, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, said
    return said.strip().split(";")[0]


def _job_state(hosts, slurm, job: str) -> str:
    out = hosts.run("node1", ["scontrol", "show", "job", job], env=slurm.env()).stdout
    found = re.search(r"JobState=(\S+)", out)
    return found.group(1) if found else "GONE"


def _wait_for_job_end(hosts, slurm, job: str, timeout: float) -> float:
    t0 = time.monotonic()
    while _job_state(hosts, slurm, job) in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED"):
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"job {job} still {_job_state(hosts, slurm, job)} after {timeout} s\n{slurm.log_tail()}",
                        pytrace=False)
        time.sleep(0.5)
    return time.monotonic() - t0


@pytest.mark.timeout(600)
@pytest.mark.parametrize("script, how", [("slurm.sbatch", "end"), ("slurm.sbatch", "power"),
                                         ("slurm-mpirun.sbatch", "power")])
def test_a_lost_slurm_node_ends_the_job_within_60s_naming_it(hosts, slurm, train_env, tmp_path, script, how):
    """Under a Slurm template (srun --kill-on-bad-exit; mpirun): node2's rank killed, or node2 powered off. (Under
    slurm-mpirun.sbatch a killed rank's job ends only after mpirun's sleeps of the odls_base_sigkill_timeout that
    template raises for preemption saves: docs/multi-gpu.md, "Preemption".)"""
    if script == "slurm-mpirun.sbatch" and cluster.missing("mpirun"):
        pytest.skip(cluster.missing("mpirun"))
    run_dir = tmp_path / "run"
    job = _job_id(_sbatch(hosts, slurm, tmp_path, script, run_dir, LONG, "lost"))
    _wait_for("checkpoint", (run_dir / "checkpoints" / "latest").is_file, 240,
              lambda: _job_output(tmp_path, "lost") + slurm.log_tail())
    t0 = time.monotonic()
    if how == "power":
        assert hosts.power_off("node2")
    else:
        assert hosts.end_processes("node2", RANK_OF_TEMPLATE, signal.SIGKILL)
    # the job's ranks on node1 end, then the job (of a silent node, Slurm itself waits for node2's slurmd)
    while hosts.pids_of("node1", RANK_OF_TEMPLATE):
        assert time.monotonic() - t0 < LOST_WITHIN_S, _job_output(tmp_path, "lost")
        time.sleep(0.5)
    took = time.monotonic() - t0
    print(f"sbatch {script}, node2 {_LOST[how]}: the ranks on node1 ended {took:.1f} s later")
    if how == "end":
        took += _wait_for_job_end(hosts, slurm, job, LOST_WITHIN_S - took)
        print(f"sbatch {script}, node2 killed: the job ended {took:.1f} s later")
    _ended_naming_node2(hosts, _job_output(tmp_path, "lost"), took, how, mpirun=script == "slurm-mpirun.sbatch")


@pytest.mark.timeout(300)
def test_preflight_checks_that_every_host_answers_ssh_and_what_a_login_host_must_set(hosts, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=1\nnode2 slots=1\n")
    argv = [sys.executable, "-m", "llmjp_ds.cli", "preflight", "--check-hosts", "--hostfile", str(hostfile)]
    good = hosts.run("node1", argv, env=_clean_env(), cwd=REPO, timeout=120)
    assert good.returncode == 0 and "hosts OK (pdsh, names, ssh to 2)" in good.stdout, good.stderr
    assert not good.stderr.strip()  # node1 runs rank 0: it ends the session to a silent host itself
    # from the login host, which runs no rank, no rank could end that session: what to set, in one line
    login = hosts.run("login", argv, env=_clean_env(), cwd=REPO, timeout=120)
    assert login.returncode == 0 and "hosts OK" in login.stdout, login.stderr
    warned = [line for line in login.stderr.splitlines() if line.strip()]
    assert len(warned) == 1 and warned[0].startswith(f"warning: {hostfile}: this host (login) runs none of its ranks")
    assert 'export PDSH_SSH_ARGS_APPEND="-o ServerAliveInterval=10 -o ServerAliveCountMax=3"' in warned[0]
    told = hosts.run("login", argv, env=_clean_env(PDSH_SSH_ARGS_APPEND="-o ServerAliveInterval=10 -o "
                                                   "ServerAliveCountMax=3"), cwd=REPO, timeout=120)
    assert told.returncode == 0 and not told.stderr.strip(), told.stderr
    # and what it says works: pdsh passes it to ssh, whose keepalive ends the session to a silent host (here 2 x 2 s)
    keepalive = _clean_env(PDSH_RCMD_TYPE="ssh",
                           PDSH_SSH_ARGS_APPEND="-o ServerAliveInterval=2 -o ServerAliveCountMax=2")
    pdsh = hosts.popen("login", ["pdsh", "-S", "-w", "node2", "sleep", "300"], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, env=keepalive)
    _wait_for("the remote sleep", lambda: hosts.pids_of("node2", "^sleep 300"), 30, lambda: "")
    t0 = time.monotonic()
    hosts.power_off("node2")
    said, _ = pdsh.communicate(timeout=30)
    assert pdsh.returncode != 0 and time.monotonic() - t0 < 15, said
    hosts.reset()
    os.kill(hosts.sshd_pids["node2"], signal.SIGTERM)  # node2 is up, but nobody answers ssh there
    bad = hosts.run("node1", argv, env=_clean_env(), cwd=REPO, timeout=120)
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert bad.returncode != 0 and len(lines) == 1, bad.stderr
    assert lines[0].startswith(f"error: {hostfile}: ssh cannot reach node2: ") and "Connection refused" in lines[0]


REQUEUE_STEPS = 120
REQUEUE_SETS = (*COMMON_SETS, *LAYOUTS["zero1"][1], f"train.steps={REQUEUE_STEPS}",
                f"optim.decay_steps={REQUEUE_STEPS}", "checkpoint.interval=10", "checkpoint.keep_last=2")


@pytest.fixture(scope="module")
def requeue_reference(train_env, tmp_path_factory) -> Path:
    """The uninterrupted run that every stopped and rerun job must equal: torchrun, two ranks on one host, once."""
    from tests.runs import run_train

    return run_train(tmp_path_factory.mktemp("requeue-reference"), 2, *REQUEUE_SETS[len(COMMON_SETS):])


def _stopped_and_resumed(run_dir: Path, reference: Path, steps: int | None = None) -> list[dict]:
    """The run's trail equals the reference's, to the bit, through ``steps`` (default: the whole run), and it was
    stopped with a save and resumed from that save; its events."""
    from llmjp_ds.metrics.record import read_metrics

    events = [r for r in read_metrics(run_dir) if "event" in r]
    stopped = [e for e in events if e["event"] == "preempted"]
    assert stopped, events
    assert any(e["event"] == "resume" and e["tag"] == stopped[0]["tag"] for e in events), events
    steps = steps or REQUEUE_STEPS
    got, ref = trail(run_dir), trail(reference)[:steps]
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    keys = ("loss", "grad_norm", "lr", "consumed_samples")
    assert [[r[k] for k in keys] for r in got] == [[r[k] for k in keys] for r in ref]
    return events


@pytest.mark.timeout(600)
@pytest.mark.parametrize("script", ["slurm.sbatch", "slurm-mpirun.sbatch"])
def test_a_usr1_before_the_time_limit_saves_requeues_and_the_rerun_ends_bit_identical(hosts, slurm, requeue_reference,
                                                                                     tmp_path, script):
    """Each Slurm template on two Slurm nodes: ``scancel --signal=USR1 --batch`` (what --signal=B:USR1@120 sends
    before the time limit) mid-run; the script's trap stops srun's tasks (they save), requeues the job, and its
    rerun resumes from `latest` to the end. The whole trail equals an uninterrupted torchrun run's, to the bit."""
    if script == "slurm-mpirun.sbatch" and cluster.missing("mpirun"):
        pytest.skip(cluster.missing("mpirun"))
    run_dir = tmp_path / "run"
    job = _job_id(_sbatch(hosts, slurm, tmp_path, script, run_dir, REQUEUE_SETS, "requeue"))

    def say() -> str:
        return _job_output(tmp_path, "requeue") + slurm.log_tail()

    _wait_for("checkpoint", (run_dir / "checkpoints" / "latest").is_file, 240, say)
    sent = hosts.run("node1", ["scancel", "--signal=USR1", "--batch", job], env=slurm.env())
    assert sent.returncode == 0, sent.stderr
    # requeued, the job waits cred_expire + 1 s before it may start again (tests/cluster.py: 10 s, not 120)
    _wait_for("last step", lambda: any(r.get("step") == REQUEUE_STEPS for r in trail(run_dir)), 300, say)
    _wait_for_job_end(hosts, slurm, job, 120)
    assert "node[1-2]" in _job_output(tmp_path, "requeue")  # the job's nodelist, as its script printed it
    # srun's tasks got SIGTERM (scancel), mpirun's ranks SIGUSR1 (forwarded by mpirun)
    _stopped_and_resumed(run_dir, requeue_reference)


# --- Grid Engine ------------------------------------------------------------------------------------------------

def _qsub(hosts, gridengine, tmp_path: Path, run_dir: Path, sets, name: str, *options: str) -> subprocess.Popen:
    """``qsub -V -terse -pe llmjp 2 [OPTIONS] hostfiles/sge-pbs.sh --set ...`` from node1, one rank a host
    (GPUS_PER_NODE=1; the PE's $round_robin puts one slot on each), its hostfile in the test's directory."""
    logs = tmp_path / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    argv = ["qsub", "-V", "-terse", "-pe", gridengine.PE, "2", "-o", str(logs / f"{name}.out"), *options,
            "hostfiles/sge-pbs.sh", *_sets(run_dir, sets)]
    env = _clean_env(**{k: v for k, v in gridengine.env().items() if k.startswith("SGE_")},
                     PATH=f"{BIN}:{os.environ['PATH']}", OMPI_ALLOW_RUN_AS_ROOT=1, OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1,
                     GPUS_PER_NODE=1, LLMJP_DS_HOSTFILE=tmp_path / "hostfile")
    return hosts.popen("node1", argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _ge_output(tmp_path: Path, name: str) -> str:
    out = tmp_path / "logs" / f"{name}.out"
    return out.read_text(errors="replace") if out.is_file() else ""


def _ge_job(hosts, gridengine, tmp_path: Path, run_dir: Path, sets, name: str):
    """(job id, what to say when a wait fails) of the template submitted without waiting, once it has saved."""
    proc = _qsub(hosts, gridengine, tmp_path, run_dir, sets, name)
    job = proc.communicate(timeout=60)[0].strip()
    assert proc.returncode == 0 and job.isdigit(), job

    def say() -> str:
        return _ge_output(tmp_path, name) + gridengine.log_tail()

    _wait_for("checkpoint", (run_dir / "checkpoints" / "latest").is_file, 240, say)
    return job, say


@pytest.mark.timeout(600)
def test_a_grid_engine_job_saves_on_notice_its_rerun_resumes_exactly_and_a_deleted_one_stays_deleted(
        hosts, gridengine, requeue_reference, tmp_path):
    """``qmod -rj`` (reschedule) mid-run: Grid Engine sends the -notify SIGUSR2, the ranks save, the script exits 99
    and the job runs again (-r y), resuming from that save. Then ``qdel`` mid-rerun: SIGUSR2 again, a save, and the
    job is gone, not rerun. Every step trained equals the uninterrupted torchrun run's, to the bit."""
    from llmjp_ds.metrics.record import read_metrics

    run_dir = tmp_path / "run"
    job, say = _ge_job(hosts, gridengine, tmp_path, run_dir, REQUEUE_SETS, "rerun")

    def events(kind: str) -> list[dict]:
        return [r for r in read_metrics(run_dir) if r.get("event") == kind]

    assert hosts.run("node1", ["qmod", "-rj", job], env=gridengine.env()).returncode == 0
    _wait_for("resume", lambda: events("resume"), 240, say)
    resumed = events("resume")[0]["tag"]
    _wait_for("checkpoint after the resume",
              lambda: (run_dir / "checkpoints" / "latest").read_text().strip() != resumed, 120, say)
    assert hosts.run("node1", ["qdel", job], env=gridengine.env()).returncode == 0
    _wait_for("the job's end", lambda: job not in gridengine.jobs(), 120, say)
    time.sleep(3)
    assert job not in gridengine.jobs() and len(events("resume")) == 1, say()  # deleted: not rerun
    assert "2 ranks on node1 node2 master node1:" in say()  # the job's hosts, as its script printed them
    stops = events("preempted")
    assert [e["reason"] for e in stops] == ["SIGUSR2", "SIGUSR2"], stops
    _stopped_and_resumed(run_dir, requeue_reference, stops[-1]["step"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("how", ["end", "power"])
def test_a_lost_grid_engine_host_ends_the_job_within_60s_naming_it(hosts, gridengine, train_env, tmp_path, how):
    """Under hostfiles/sge-pbs.sh (mpirun over ssh): node2's rank killed, or node2 powered off (rank 0 names it and
    ends mpirun); Grid Engine's job is gone within 60 s, with the one line."""
    run_dir = tmp_path / "run"
    job, say = _ge_job(hosts, gridengine, tmp_path, run_dir, LONG, "lost")
    t0 = time.monotonic()
    if how == "power":
        assert hosts.power_off("node2")
    else:
        assert hosts.end_processes("node2", RANK_OF_TEMPLATE, signal.SIGKILL)
    _wait_for("the job's end", lambda: job not in gridengine.jobs(), LOST_WITHIN_S, say)
    took = time.monotonic() - t0
    print(f"qsub hostfiles/sge-pbs.sh (mpirun), node2 {_LOST[how]}: the job ended {took:.1f} s later")
    assert not hosts.pids_of("node1", r"llmjp_ds\.train|mpirun")
    _ended_naming_node2(hosts, _ge_output(tmp_path, "lost"), took, how, mpirun=True)
