"""Bad inputs of the catalogue, clusters: scheduler environments that contradict themselves, and hostfiles
written from an allocation (``llmjp-ds preflight --write-hostfile``). A training case fails before DeepSpeed."""

from __future__ import annotations

from tests.reliability.cases import Case, L, T

# a task of an srun step of 2 tasks on one node (values blank = unset: the harness's own environment may hold some)
STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
        "SLURM_JOB_NODELIST": "localhost", "SLURM_NTASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "",
        "SLURM_STEP_TASKS_PER_NODE": "", "SLURM_TASKS_PER_NODE": ""}
NO_ALLOCATION = {key: "" for key in ("PE_HOSTFILE", "PBS_NODEFILE", "SLURM_JOB_NODELIST", "SLURM_NODELIST",
                                     "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_PROCID")}
OMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2", **NO_ALLOCATION}
WRITE = ("preflight", "--write-hostfile", "{tmp}/cluster/hosts_x")
CHECK = ("preflight", "--check-hosts", "--hostfile")

CASES: list[Case] = [
    Case("slurm-procid-not-below-ntasks", T(), ("SLURM_PROCID=2 is not below SLURM_NTASKS=2: the Slurm environment "
                                                "contradicts itself",), env={**STEP, "SLURM_PROCID": "2"}, trains=True),
    Case("slurm-rank-contradicts-procid", T(),
         ("RANK=0 (a stale export?) contradicts SLURM_PROCID=1 (both in a world of 2): unset RANK and WORLD_SIZE",),
         env={**STEP, "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "RANK": "0", "WORLD_SIZE": "2"}, trains=True),
    Case("slurm-nodelist-unparsable", T(),
         ("SLURM_JOB_NODELIST='node[01-03' cannot be parsed as a Slurm hostlist (a '[' is never closed)",),
         env={**STEP, "SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "node[01-03"}, trains=True),
    Case("openmpi-without-master-addr", T(),
         ("openmpi rank 1 of 2 (OMPI_COMM_WORLD_RANK) has no MASTER_ADDR and MASTER_PORT",
          "pass `-x MASTER_ADDR=<first host> -x MASTER_PORT=<free port>` to mpirun"), env=OMPI, trains=True),
    Case("write-hostfile-without-allocation", L(*WRITE),
         ("none of $PE_HOSTFILE (SGE), $PBS_NODEFILE (PBS) or $SLURM_JOB_NODELIST (Slurm) is set",),
         env=NO_ALLOCATION),
    Case("write-hostfile-pe-hostfile-unreadable", L(*WRITE),
         ("cannot read $PE_HOSTFILE /nonexistent/llmjp-ds/pe_hostfile (No such file or directory)",),
         env={**NO_ALLOCATION, "PE_HOSTFILE": "/nonexistent/llmjp-ds/pe_hostfile"}),
    Case("write-hostfile-slots-disagree", L(*WRITE, "--slots", "4"),
         ("--slots 4 disagrees with SLURM_NTASKS_PER_NODE=8 (the job's --ntasks-per-node): pass --slots 8",),
         env={**NO_ALLOCATION, "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_NTASKS_PER_NODE": "8"}),
    Case("hostfile-host-does-not-resolve", L(*CHECK, "{tmp}/cluster/unresolvable"),
         ("cluster/unresolvable: host no-such-node.invalid does not resolve here",
          "add it to DNS or /etc/hosts on every host"), env=NO_ALLOCATION),
    Case("hostfile-slots-disagree-with-ntasks-per-node", L(*CHECK, "{tmp}/cluster/two_nodes"),
         ("cluster/two_nodes: node01 has slots=8 but the Slurm job runs 4 tasks per node",),
         env={**NO_ALLOCATION, "SLURM_NTASKS_PER_NODE": "4"}),
    Case("hostfile-without-pdsh", L(*CHECK, "{tmp}/cluster/two_local"),
         ("pdsh is not installed: the deepspeed launcher starts the other 1 hosts of", "install it (apt install pdsh"),
         env={**NO_ALLOCATION, "PATH": "{tmp}/cluster/empty_bin"}),
]


def prepare(ctx) -> None:
    """A directory for the hostfiles the cases must not write, the hostfiles they check, and an empty PATH."""
    (ctx.tmp / "cluster").mkdir()
    (ctx.tmp / "cluster" / "empty_bin").mkdir()
    (ctx.tmp / "cluster" / "unresolvable").write_text("localhost slots=1\nno-such-node.invalid slots=1\n")
    (ctx.tmp / "cluster" / "two_nodes").write_text("node01 slots=8\nnode02 slots=8\n")
    # two names that resolve on any machine: the launcher's check of pdsh comes after the names'
    (ctx.tmp / "cluster" / "two_local").write_text("localhost slots=1\n127.0.0.1 slots=1\n")
