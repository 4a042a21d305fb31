"""Where a process stands in its job (``launch/scheduler.py``), Slurm's host lists (``launch/hostlist.py``) and
hostfiles written from an allocation (``launch/hostfile.py``): pure functions on synthetic environments."""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from llmjp_ds.errors import UserError
from llmjp_ds.launch import scheduler
from llmjp_ds.launch.hostfile import allocation_hosts, hostfile_text, write_hostfile
from llmjp_ds.launch.hostlist import HostlistError, expand_hostlist, expand_tasks_per_node
from llmjp_ds.launch.scheduler import JobEnv, detect, export, prepare_launch
from llmjp_ds.launch.hosts import parse_hostfile

# --- Slurm's host lists ----------------------------------------------------------------------------------

# `scontrol show hostnames LIST` prints one name a line, in this order (Slurm's hostlist.c)
EXPANSIONS = {
    "node01": "node01",
    "node[01-03,07],gpu-a[1-2]": "node01 node02 node03 node07 gpu-a1 gpu-a2",
    "rack[1-2]-n[01-02]": "rack1-n01 rack1-n02 rack2-n01 rack2-n02",
    "n[8-10]": "n8 n9 n10",
    "n[08-10]": "n08 n09 n10",
    "n[098-101]": "n098 n099 n100 n101",
    "a1,b[2],c.example.org": "a1 b2 c.example.org",
    "gpu[1-2]x,cpu-[3]": "gpu1x gpu2x cpu-3",
    "n[1,1]": "n1 n1",
}


@pytest.mark.parametrize("text", sorted(EXPANSIONS))
def test_hostlist_expands_as_scontrol_show_hostnames(text):
    assert "\n".join(expand_hostlist(text)) == "\n".join(EXPANSIONS[text].split())


@pytest.mark.parametrize("text, reason", [
    ("node[01-03", "never closed"), ("node]1", "closes nothing"), ("n[[1]]", "opens inside another"),
    ("n[3-1]", "reversed range"), ("n[a-b]", "not a number"), ("n[]", "not a number"), ("a,,b", "empty name"),
    ("", "empty"), ("bad host", "' '"), ("n[0-99999999]", "more than"),
])
def test_hostlist_refuses_what_slurm_would_not_read(text, reason):
    with pytest.raises(HostlistError, match=reason.replace("[", r"\[")):
        expand_hostlist(text)


def test_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("8") == [8]
    with pytest.raises(HostlistError):
        expand_tasks_per_node("2(3)")


def test_an_unparsable_nodelist_is_one_line_naming_the_variable(monkeypatch):
    monkeypatch.setattr(scheduler, "_scontrol_hostnames", lambda text: None)
    with pytest.raises(UserError) as info:
        scheduler.hostnames("SLURM_JOB_NODELIST", "node[01-03")
    assert str(info.value).startswith("SLURM_JOB_NODELIST='node[01-03' cannot be parsed as a Slurm hostlist (a '['")
    monkeypatch.setattr(scheduler, "_scontrol_hostnames", lambda text: ["x1", "x2"])  # scontrol knows better
    assert scheduler.hostnames("SLURM_JOB_NODELIST", "x[1-2]:weird") == ["x1", "x2"]


# --- each source's decision -------------------------------------------------------------------------------

def slurm(procid=0, ntasks=4, localid=None, nodeid=None, **more) -> dict:
    """A task of an srun step: 2 nodes x 2 tasks, job 1234567 (port 10000 + 1234567 % 50000 = 44567)."""
    per_node = 2
    env = {"SLURM_JOB_ID": "1234567", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(procid), "SLURM_NTASKS": str(ntasks),
           "SLURM_LOCALID": str(procid % per_node if localid is None else localid),
           "SLURM_NODEID": str(procid // per_node if nodeid is None else nodeid),
           "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_NODELIST": "gpu[07-08]",
           "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NNODES": "2"}
    env.update({k: str(v) for k, v in more.items()})
    return env


def test_a_lone_process_and_a_launchers_variables_are_taken_as_they_are():
    assert detect({}) == JobEnv("single process")
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2",
                "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none"}
    assert detect(torchrun) == JobEnv("torchrun", 3, 4, 1, 2, 2, "10.0.0.1", 29500)
    deepspeed = {"RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_SIZE": "8", "CROSS_RANK": "1",
                 "CROSS_SIZE": "2", "MASTER_ADDR": "h1", "MASTER_PORT": "29500"}
    assert detect(deepspeed) == JobEnv("deepspeed", 9, 16, 1, 8, 2, "h1", 29500)
    assert detect({"WORLD_SIZE": "3"}) == JobEnv("environment", 0, 3)  # the bad-input catalogue's way


def test_a_slurm_step_task():
    job = detect(slurm(procid=3))
    assert job == JobEnv("slurm", 3, 4, 1, 2, 2, "gpu07", 10000 + 1234567 % 50000, ("gpu07", "gpu08"))
    assert job.describe() == "launch: slurm, world 4, nodes 2, master gpu07:44567"
    assert detect(slurm(MASTER_PORT=6000, MASTER_ADDR="gpu07-ib")).master_addr == "gpu07-ib"
    assert detect(slurm(MASTER_PORT=6000)).master_port == 6000
    uneven = slurm(procid=4, ntasks=5, SLURM_STEP_TASKS_PER_NODE="2(x2),1", SLURM_STEP_NODELIST="n[1-3]", nodeid=2,
                   localid=0)
    assert detect(uneven).local_world_size == 1 and detect(uneven).master_addr == "n1"


def test_only_a_steps_tasks_count():
    batch = slurm(ntasks=16)
    del batch["SLURM_STEP_ID"]  # the sbatch script itself: SLURM_PROCID=0, SLURM_NTASKS, no step
    assert detect(batch).source == "single process"
    assert detect(slurm(SLURM_STEP_ID=str(0xFFFFFFFB))).source == "single process"  # the batch step's id
    assert detect(slurm(procid=0, ntasks=1, SLURM_STEP_TASKS_PER_NODE="1")) == JobEnv("slurm", 0, 1, 0, 1)


def test_a_one_task_world_exports_nothing():
    env = slurm(procid=0, ntasks=1, SLURM_STEP_TASKS_PER_NODE="1")
    before = dict(env)
    export(detect(env), env)
    assert env == before  # a lone task picks its own free port, as `python -m llmjp_ds.train` does


def test_openmpi():
    ompi = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    with pytest.raises(UserError) as info:
        detect(ompi)
    message = str(info.value)
    assert message.startswith("openmpi rank 5 of 8 (OMPI_COMM_WORLD_RANK) has no MASTER_ADDR and MASTER_PORT")
    assert "-x MASTER_ADDR=<first host> -x MASTER_PORT=<free port>" in message and "\n" not in message
    given = {**ompi, "MASTER_ADDR": "h1", "MASTER_PORT": "29400"}
    assert detect(given) == JobEnv("openmpi", 5, 8, 1, 4, 2, "h1", 29400)
    # mpirun in an sbatch script: its daemons' srun step (one task per node) is not the world; the job's first
    # node and id give the master, as LLM-jp's sbatch computes them
    inside = {**ompi, **slurm(procid=1, ntasks=2, SLURM_STEP_TASKS_PER_NODE="1(x2)")}
    assert detect(inside) == JobEnv("openmpi", 5, 8, 1, 4, 2, "gpu07", 44567, ("gpu07", "gpu08"))
    assert detect({**ompi, "OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"}).world_size == 1


def test_mpich_and_intel_mpi():
    hydra = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "MASTER_ADDR": "h1",
             "MASTER_PORT": "1234"}
    assert detect(hydra) == JobEnv("pmi", 3, 4, 1, 2, 2, "h1", 1234)
    # srun --mpi=pmi2: PMI's world is the step's, which says the rest
    assert detect({**slurm(procid=3), "PMI_RANK": "3", "PMI_SIZE": "4"}).source == "slurm"
    with pytest.raises(UserError, match="PMI_RANK=2 contradicts SLURM_PROCID=3"):
        detect({**slurm(procid=3), "PMI_RANK": "2", "PMI_SIZE": "4"})


def test_torchrun_inside_an_srun_step_keeps_its_own_ranks():
    """srun --ntasks-per-node=1 torchrun --nproc-per-node=2: RANK differs from SLURM_PROCID, legitimately."""
    env = {**slurm(procid=0, ntasks=2, SLURM_STEP_TASKS_PER_NODE="1(x2)"), "RANK": "3", "WORLD_SIZE": "4",
           "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x", "MASTER_ADDR": "gpu08",
           "MASTER_PORT": "29500"}
    assert detect(env).source == "torchrun" and detect(env).rank == 3
    del env["TORCHELASTIC_RUN_ID"]  # a wrapper numbering several workers per task: a larger world, kept
    assert detect(env).source == "environment" and detect(env).rank == 3
    # RANK / WORLD_SIZE that agree with the step: the step's view (it knows nodes and local ranks)
    assert detect({**slurm(procid=2), "RANK": "2", "WORLD_SIZE": "4"}).source == "slurm"


@pytest.mark.parametrize("env, fragments", [
    ({**slurm(procid=1), "RANK": "0", "WORLD_SIZE": "4"},
     ("RANK=0 (a stale export?) contradicts SLURM_PROCID=1", "unset RANK and WORLD_SIZE")),
    ({**slurm(procid=1), "RANK": "0"}, ("RANK=0 is set without WORLD_SIZE (a stale export?) in a slurm task",)),
    ({**slurm(procid=1), "RANK": "0", "WORLD_SIZE": "1"},
     ("WORLD_SIZE=1 (a stale export?) contradicts SLURM_NTASKS=4",)),
    ({**slurm(procid=1), "WORLD_SIZE": "8"}, ("WORLD_SIZE=8 (a stale export?) contradicts SLURM_NTASKS=4",)),
    (slurm(procid=4), ("SLURM_PROCID=4 is not below SLURM_NTASKS=4: the Slurm environment contradicts itself",)),
    (slurm(procid=1, localid=2), ("SLURM_LOCALID=2 is not below this node's task count=2",)),
    (slurm(procid=1, nodeid=2), ("SLURM_NODEID=2 is not below the 2 nodes of SLURM_STEP_NODELIST",)),
    (slurm(SLURM_STEP_TASKS_PER_NODE="2(x3)"), ("counts 3 nodes but SLURM_STEP_NODELIST lists 2",)),
    (slurm(SLURM_STEP_TASKS_PER_NODE="3(x2)"), ("adds up to 6 tasks but SLURM_NTASKS=4",)),
    (slurm(MASTER_ADDR="127.0.0.1"), ("MASTER_ADDR=127.0.0.1 (a stale export?) is a loopback address, but the "
                                      "Slurm step spans 2 nodes",)),
    (slurm(SLURM_STEP_NODELIST="gpu[07-08"), ("SLURM_STEP_NODELIST='gpu[07-08' cannot be parsed",)),
    (slurm(SLURM_NTASKS="four"), ("SLURM_NTASKS='four' is not a whole number",)),
    ({"RANK": "2", "WORLD_SIZE": "2"}, ("RANK=2 is not below WORLD_SIZE=2",)),
])
def test_contradictions_are_one_line_naming_both(env, fragments, monkeypatch):
    monkeypatch.setattr(scheduler, "_scontrol_hostnames", lambda text: None)
    with pytest.raises(UserError) as info:
        detect(env)
    message = str(info.value)
    assert "\n" not in message and all(f in message for f in fragments), message


def test_export_gives_the_rest_one_world():
    env = slurm(procid=3, SLURM_JOB_ID="77", LLMJP_DS_SOCKET_IFNAME="lo")  # the override: no name lookups here
    job = prepare_launch(env)
    assert {k: env[k] for k in scheduler_vars()} == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "gpu07",
        "MASTER_PORT": "10077"}
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "lo"  # two nodes: the interface is set
    assert detect(env) == job  # the exported variables agree with the step: deciding again changes nothing
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x", "MASTER_PORT": "29500"}
    before = dict(torchrun)
    prepare_launch(torchrun)
    assert torchrun == before  # today's path, untouched


def scheduler_vars():
    return ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# --- the interface a rank advertises ----------------------------------------------------------------------

def _own_addresses() -> list[tuple[str, str]]:
    """(interface, IPv4 address) of this host's non-loopback interfaces (routing to them sends nothing out)."""
    return [(name, a.address) for name, addrs in psutil.net_if_addrs().items() for a in addrs
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback]


def test_the_route_to_loopback_is_lo():
    local, name = scheduler.route_interface("127.0.0.1", 29500)
    assert local == "127.0.0.1" and name == scheduler.interface_of("127.0.0.1") and name in ("lo", "lo0")
    assert scheduler.choose_interface("127.0.0.1", 29500, env={}) is None  # never advertise loopback


def test_the_master_takes_the_route_to_another_node():
    own = _own_addresses()
    if not own:
        pytest.skip("this host has no non-loopback IPv4 address")
    name, address = own[0]
    assert scheduler.choose_interface(address, 29500, env={}) == name
    # on the master, whose own name may resolve to loopback: the route to the next node of the list
    assert scheduler.choose_interface("127.0.0.1", 29500, [address], env={}) == name
    env = {}
    job = JobEnv("slurm", 0, 4, 0, 2, 2, "127.0.0.1", 29500, ("127.0.0.1", address))
    assert scheduler.set_socket_interface(job, env) == name
    assert env == {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": name}
    env = {"GLOO_SOCKET_IFNAME": "lo"}  # the user's choice stands, and NCCL gets it too
    scheduler.set_socket_interface(job, env)
    assert env == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def test_one_node_changes_nothing_and_overrides_are_checked(monkeypatch):
    env = {}
    assert scheduler.set_socket_interface(JobEnv("slurm", 0, 2, 0, 2, 1, "127.0.0.1", 29500), env) is None
    assert env == {}
    assert scheduler.choose_interface("127.0.0.1", 1, env={"LLMJP_DS_SOCKET_IFNAME": "lo"}) == "lo"
    with pytest.raises(UserError, match="LLMJP_DS_SOCKET_IFNAME=nope0 names no interface of"):
        scheduler.choose_interface("127.0.0.1", 1, env={"LLMJP_DS_SOCKET_IFNAME": "nope0"})

    def unknown(addr, port):  # a name lookup that fails (tests look up no names beyond this host)
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(scheduler, "route_interface", unknown)
    with pytest.raises(UserError, match="MASTER_ADDR gpu07 does not resolve or route on .* Name or service not"):
        scheduler.choose_interface("gpu07", 1, env={})


# --- hostfiles from an allocation ------------------------------------------------------------------------

def test_sge_pe_hostfile(tmp_path):
    pe = tmp_path / "pe_hostfile"
    pe.write_text("g0001.abci.local 40 gpu@g0001 UNDEFINED\ng0002.abci.local 40 gpu@g0002 UNDEFINED\n"
                  "g0001.abci.local 8 short@g0001 UNDEFINED\n")
    out = tmp_path / "hosts"
    line = write_hostfile(out, {"PE_HOSTFILE": str(pe)})
    assert line == f"wrote {out} from $PE_HOSTFILE (SGE): 2 hosts, 88 slots"
    assert out.read_text() == ("# written by llmjp-ds preflight --write-hostfile from $PE_HOSTFILE\n"
                               "g0001.abci.local slots=48\ng0002.abci.local slots=40\n")
    write_hostfile(out, {"PE_HOSTFILE": str(pe)}, slots=4)  # SGE counts CPU slots: give GPUs per node
    assert parse_hostfile(out) == {"g0001.abci.local": 4, "g0002.abci.local": 4}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hosts", "pe_hostfile"]  # no temp file left


def test_pbs_nodefile(tmp_path):
    nodes = tmp_path / "nodefile"
    nodes.write_text("x1001\nx1001\nx1002\nx1001\nx1002\n\n")
    assert allocation_hosts({"PBS_NODEFILE": str(nodes)}) == ("PBS_NODEFILE", {"x1001": 3, "x1002": 2})
    write_hostfile(tmp_path / "hosts", {"PBS_NODEFILE": str(nodes)})
    assert parse_hostfile(tmp_path / "hosts") == {"x1001": 3, "x1002": 2}


def test_slurm_nodelist(tmp_path):
    env = {"SLURM_JOB_NODELIST": "gpu[01-02],cpu7", "SLURM_TASKS_PER_NODE": "8(x2),4"}
    assert allocation_hosts(env) == ("SLURM_JOB_NODELIST", {"gpu01": 8, "gpu02": 8, "cpu7": 4})
    one_task = {"SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_TASKS_PER_NODE": "1(x2)"}
    assert allocation_hosts(one_task, slots=8)[1] == {"gpu01": 8, "gpu02": 8}  # deepspeed's 1 task per node
    per_node = {**one_task, "SLURM_NTASKS_PER_NODE": "8"}
    write_hostfile(tmp_path / "hosts", per_node)
    assert parse_hostfile(tmp_path / "hosts") == {"gpu01": 8, "gpu02": 8}
    assert hostfile_text({"a": 1}, "$X") == "# written by llmjp-ds preflight --write-hostfile from $X\na slots=1\n"


@pytest.mark.parametrize("env, slots, fragment", [
    ({}, None, "none of $PE_HOSTFILE (SGE), $PBS_NODEFILE (PBS) or $SLURM_JOB_NODELIST (Slurm) is set"),
    ({"PE_HOSTFILE": "{tmp}"}, None, "cannot read $PE_HOSTFILE"),
    ({"PE_HOSTFILE": "{tmp}/missing"}, None, "(No such file or directory): run this inside the job"),
    ({"PE_HOSTFILE": "{tmp}/garbled"}, None, "garbled:1: 'g1 many gpu' is not SGE's 'host slots queue processors'"),
    ({"PBS_NODEFILE": "{tmp}/empty"}, None, "lists no hosts"),
    ({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NTASKS_PER_NODE": "8"}, 4,
     "--slots 4 disagrees with SLURM_NTASKS_PER_NODE=8 (the job's --ntasks-per-node): pass --slots 8"),
    ({"SLURM_JOB_NODELIST": "n[1-2]"}, None, "no slots are known"),
    ({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "8(x3)"}, None, "counts 3 nodes"),
    ({"SLURM_JOB_NODELIST": "n1"}, 0, "--slots 0: a host needs at least 1 slot"),
])
def test_hostfile_refusals(tmp_path, env, slots, fragment, monkeypatch):
    monkeypatch.setattr(scheduler, "_scontrol_hostnames", lambda text: None)
    (tmp_path / "garbled").write_text("g1 many gpu\n")
    (tmp_path / "empty").write_text("\n")
    env = {k: v.replace("{tmp}", str(tmp_path)) for k, v in env.items()}
    with pytest.raises(UserError) as info:
        write_hostfile(tmp_path / "out", env, slots)
    assert fragment in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert not (tmp_path / "out").exists()


def test_preflight_writes_and_checks_the_allocation(tmp_path, monkeypatch, capsys):
    from llmjp_ds import preflight

    for key in [k for k in os.environ if k.startswith(("SLURM_", "OMPI_", "PMI_", "PE_", "PBS_"))] + list(
            scheduler_vars()):
        monkeypatch.delenv(key, raising=False)
    for key, value in slurm(procid=1).items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "hosts"
    assert preflight.cli_main(["--write-hostfile", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["launch: slurm, world 4, nodes 2, master gpu07:44567",
                     f"wrote {out} from $SLURM_JOB_NODELIST (Slurm): 2 hosts, 4 slots", f"{out}: 2 hosts, 4 ranks"]
    with pytest.raises(UserError, match="pass --hostfile FILE"):
        preflight.cli_main([])


# --- the job-script templates (hostfiles/), run by bash against stand-ins for srun, mpirun, scontrol, deepspeed --

REPO = Path(__file__).resolve().parents[2]
STAND_IN = """#!/bin/bash
hold=; if [ "$(basename "$0")" != scontrol ] && [ -n "${HOLD:-}" ]; then hold=1; fi
if [ -n "$hold" ]; then  # before the line below, which tells the test it may signal
    trap 'echo "$(basename "$0") got TERM" >> "$LOG"; exit 0' TERM
    trap 'echo "$(basename "$0") got USR1" >> "$LOG"; exit 0' USR1
    trap 'echo "$(basename "$0") got USR2" >> "$LOG"; exit 0' USR2
fi
echo "$(basename "$0") $* | ${MASTER_ADDR:-}:${MASTER_PORT:-}" >> "$LOG"
if [ "$(basename "$0")" = scontrol ] && [ "$1" = show ]; then printf 'n1\\nn2\\n'; fi
if [ "$(basename "$0")" = scancel ]; then kill -TERM "$(cat "$LOG.launcher.pid")"; exit 0; fi
case "$(basename "$0")" in srun|mpirun) echo $$ > "$LOG.launcher.pid";; esac
if [ -n "$hold" ]; then
    sleep 30 & wait
fi
"""


def _stand_ins(tmp_path) -> dict:
    """PATH with stand-ins that log their arguments (and, with HOLD=1, wait for SIGTERM as a training would)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("srun", "mpirun", "scontrol", "scancel", "deepspeed"):
        (bin_dir / name).write_text(STAND_IN)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PE_", "PBS_"))}
    env.update(PATH=f"{bin_dir}:{Path(sys.executable).parent}:{env.get('PATH', '')}", LOG=str(tmp_path / "log"),
               SLURM_JOB_ID="1234567", SLURM_JOBID="1234567", SLURM_JOB_NODELIST="n[1-2]", SLURM_NTASKS="4",
               SLURM_NTASKS_PER_NODE="2", SLURM_SUBMIT_DIR=str(REPO))
    return env


def _log(tmp_path) -> list[str]:
    return (tmp_path / "log").read_text().splitlines() if (tmp_path / "log").exists() else []


@pytest.mark.parametrize("script, launch", [
    ("slurm.sbatch", "srun --kill-on-bad-exit=1 python -m llmjp_ds.train --config run.yaml --set a=b | :"),
    ("slurm-mpirun.sbatch", "mpirun -np 4 --npernode 2 -bind-to none -map-by slot -x MASTER_ADDR -x MASTER_PORT -x "
                            "PATH -x LD_LIBRARY_PATH python -m llmjp_ds.train --set "
                            "checkpoint.stop_signals=[SIGTERM,SIGINT,SIGUSR1] --config run.yaml --set a=b | n1:44567"),
])
def test_slurm_templates_launch_and_requeue_before_the_time_limit(tmp_path, script, launch):
    env = _stand_ins(tmp_path)
    argv = ["bash", str(REPO / "hostfiles" / script), "--config", "run.yaml", "--set", "a=b"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert launch in _log(tmp_path)  # mpirun's rendezvous: LLM-jp's rule, which scheduler.slurm_port matches
    assert scheduler.slurm_port(env) == 44567
    (tmp_path / "log").unlink()
    job = subprocess.Popen(argv, env={**env, "HOLD": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while not any(line.startswith(("srun", "mpirun")) for line in _log(tmp_path)):
            assert time.monotonic() < deadline and job.poll() is None, job.communicate()
            time.sleep(0.05)
        job.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@120 sends the batch script
        assert job.wait(20) == 0, job.communicate()
    finally:
        job.kill()
    launcher = launch.split()[0]
    after = [line for line in _log(tmp_path) if not line.startswith((f"{launcher} -", "scontrol show"))]
    rendezvous = launch.rsplit('| ', 1)[1]
    # srun: SIGTERM to the steps' tasks through scancel (not the script); mpirun: SIGUSR1, which it forwards
    stop = [f"scancel --signal=TERM 1234567 | {rendezvous}", "srun got TERM"] if launcher == "srun" else [
        "mpirun got USR1"]
    assert after == [*stop, f"scontrol requeue 1234567 | {rendezvous}"]


@pytest.mark.parametrize("scheduler", ["sge", "pbs"])
def test_sge_pbs_template_writes_the_hostfile_starts_mpirun_and_forwards_a_stop(tmp_path, scheduler):
    """Grid Engine's $PE_HOSTFILE or PBS Pro's $PBS_NODEFILE (ABCI 3.0: a line per MPI process) becomes the
    hostfile mpirun reads; a stop (Grid Engine's SIGUSR2 before it kills the job, PBS's SIGTERM) reaches mpirun as
    SIGUSR2, which it forwards to the ranks, and under Grid Engine the script then exits 99: queue the job again."""
    env = _stand_ins(tmp_path)
    forwarded = ("NCCL_", "GLOO_", "UCX_", "PYTHON", "TORCH_", "OMP_NUM_THREADS", "HF_", "TRANSFORMERS_", "TOKENIZERS_",
                 "LLMJP_DS_", "NVTE_", "PYTORCH_", "CUDA_DEVICE_MAX_CONNECTIONS")
    for key in [k for k in env if k.startswith(("SLURM_", *forwarded))]:
        del env[key]
    # ssh carries none of the submitting shell's variables to the other hosts: these must go by -x, a host's own not
    env.update(NCCL_SOCKET_IFNAME="ib0", GLOO_SOCKET_IFNAME="ib0", TORCH_EXTENSIONS_DIR=str(tmp_path / "ops"),
               NVTE_FUSED_ATTN="0", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True", CUDA_DEVICE_MAX_CONNECTIONS="1",
               CUDA_VISIBLE_DEVICES="0,1")
    hostfile = tmp_path / "hostfile"
    if scheduler == "sge":
        (tmp_path / "pe").write_text("g1 40 gpu@g1 UNDEFINED\ng2 40 gpu@g2 UNDEFINED\n")
        env.update(PE_HOSTFILE=str(tmp_path / "pe"), GPUS_PER_NODE="2", JOB_ID="1234567", SGE_ROOT=str(tmp_path),
                   SGE_O_WORKDIR=str(REPO))
        wrote, stop, status = "$PE_HOSTFILE (SGE): 2 hosts, 4 slots", signal.SIGUSR2, 99
    else:
        (tmp_path / "nodes").write_text("g1\ng1\ng2\ng2\n")
        env.update(PBS_NODEFILE=str(tmp_path / "nodes"), PBS_JOBID="1234567.pbs1", PBS_O_WORKDIR=str(REPO))
        wrote, stop, status = "$PBS_NODEFILE (PBS): 2 hosts, 4 slots", signal.SIGTERM, 0
    env.update(LLMJP_DS_HOSTFILE=str(hostfile))
    argv = ["bash", str(REPO / "hostfiles" / "sge-pbs.sh")]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"wrote {hostfile} from {wrote}" in done.stdout
    assert parse_hostfile(hostfile) == {"g1": 2, "g2": 2}
    assert _log(tmp_path) == [  # LLM-jp's port rule, from the job id
        f"mpirun -np 4 --hostfile {hostfile} -bind-to none -map-by slot -mca plm_rsh_disable_qrsh 1 -x MASTER_ADDR "
        "-x MASTER_PORT -x PATH -x LD_LIBRARY_PATH -x CUDA_DEVICE_MAX_CONNECTIONS -x GLOO_SOCKET_IFNAME "
        "-x LLMJP_DS_HOSTFILE -x NCCL_SOCKET_IFNAME -x NVTE_FUSED_ATTN -x PYTORCH_CUDA_ALLOC_CONF "
        "-x TORCH_EXTENSIONS_DIR python -m llmjp_ds.train --set checkpoint.stop_signals=[SIGTERM,SIGINT,SIGUSR2] "
        "| g1:44567"]
    (tmp_path / "log").unlink()
    job = subprocess.Popen(argv, env={**env, "HOLD": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not any(line.startswith("mpirun") for line in _log(tmp_path)):
            assert time.monotonic() < deadline and job.poll() is None, job.communicate()
            time.sleep(0.05)
        job.send_signal(stop)
        assert job.wait(20) == status, job.communicate()
    finally:
        job.kill()
    assert _log(tmp_path)[1:] == ["mpirun got USR2"]
