"""Where this process stands in its job, read from what its launcher or scheduler put in the environment.

``python -m llmjp_ds.train`` may be started by torchrun, the deepspeed launcher, ``srun``, ``mpirun`` or by hand.
:func:`detect` reads an environment mapping (a plain dict in tests) and returns a :class:`JobEnv`: rank, world,
local rank, nodes, the rendezvous address, and ``source``, where it found them. Precedence, the launcher nearest
the process first:

1. **torchrun / the deepspeed launcher** (``torchrun``, ``deepspeed``): RANK, WORLD_SIZE, LOCAL_RANK,
   LOCAL_WORLD_SIZE (deepspeed: LOCAL_SIZE), MASTER_ADDR, MASTER_PORT, recognised by the launcher's own marker
   (torchrun: TORCHELASTIC_RUN_ID; deepspeed's ``launch``: CROSS_RANK; its mpich / impi runners: LOCAL_SIZE).
   Taken as they are: inside an srun step torchrun's RANK differs from SLURM_PROCID (several workers per task,
   ranks given at rendezvous).
2. **OpenMPI's mpirun** (``openmpi``; ``deepspeed --launcher openmpi`` too): OMPI_COMM_WORLD_RANK, _SIZE,
   _LOCAL_RANK, _LOCAL_SIZE. mpirun gives no rendezvous address: MASTER_ADDR and MASTER_PORT come from the
   environment (``mpirun -x MASTER_ADDR -x MASTER_PORT``) or, inside a Slurm job, from its nodelist and job id
   as in 4 (LLM-jp's sbatch rule).
3. **MPICH / Intel MPI** (``pmi``): PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS, the same way. When a
   Slurm step has as many tasks as PMI_SIZE (``srun --mpi=pmi2``), the step is the world and 4 applies.
4. **A task of a Slurm step** (``slurm``; ``srun``, ``deepspeed --launcher slurm``): SLURM_PROCID, SLURM_NTASKS,
   SLURM_LOCALID, SLURM_NODEID, the nodelist (SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST or SLURM_NODELIST)
   and the tasks per node (SLURM_STEP_TASKS_PER_NODE or SLURM_TASKS_PER_NODE, e.g. ``2(x3),1``, else
   SLURM_NTASKS_PER_NODE). Master: MASTER_ADDR if set, else the nodelist's first host; port: MASTER_PORT if
   set, else 10000 + SLURM_JOB_ID % 50000. Only a step's task counts: an sbatch script itself has SLURM_PROCID
   and SLURM_NTASKS but no SLURM_STEP_ID, and is one process.
5. Otherwise RANK / WORLD_SIZE set by hand or by a wrapper (``environment``), or **a single process**
   (``single process``): today's path, unchanged.

MPI outranks Slurm because mpirun in an sbatch script starts its daemons with srun: its ranks inherit that
daemon step's Slurm variables (SLURM_PROCID = the node's index, SLURM_NTASKS = the node count).

**Contradictions** end in one line naming both sides. RANK / WORLD_SIZE without a launcher's marker beside a
scheduler's variables: a larger WORLD_SIZE, with RANK, is a launcher running several workers per task (kept);
the same world with another rank, any other world, or RANK without WORLD_SIZE is a stale export.
Inside one scheduler: a rank not below the world, a local rank not below its node's tasks, tasks per node that
do not add up to the world, a loopback MASTER_ADDR for a Slurm step over several nodes.

:func:`export` writes the decision as torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), so DeepSpeed, validation (ranks per node) and the run-dir lock see one world; a
launcher's variables and a one-process world are left alone (a lone process picks a free port in
``context.init_distributed``). :func:`set_socket_interface`: over several nodes each rank must advertise an
address the others reach (gloo otherwise takes its host name's, which may be loopback): the interface named by
LLMJP_DS_SOCKET_IFNAME, GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME, else the one of the route to the master (on
the master itself, to another node), goes into GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME where unset; on one
node nothing changes. :func:`prepare_launch` does all three, before anything reads the world size.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import subprocess
from dataclasses import dataclass
from typing import Mapping, MutableMapping

import psutil

from llmjp_ds.errors import fail
from llmjp_ds.launch.hostlist import HostlistError, expand_hostlist, expand_tasks_per_node

KEPT = ("torchrun", "deepspeed", "environment", "single process")  # sources whose variables stay as they are
SCHEDULER_KEYS = {"slurm": ("SLURM_PROCID", "SLURM_NTASKS"), "pmi": ("PMI_RANK", "PMI_SIZE"),
                  "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")}
MPI_KEYS = {"openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                        "OMPI_COMM_WORLD_LOCAL_SIZE"),
            "pmi": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")}
MASTER_FLAGS = {"openmpi": "`-x MASTER_ADDR=<first host> -x MASTER_PORT=<free port>` to mpirun (with `deepspeed "
                           "--launcher openmpi`: MASTER_ADDR=... and MASTER_PORT=... lines in .deepspeed_env)",
                "pmi": "`-genv MASTER_ADDR <first host> -genv MASTER_PORT <free port>` to mpiexec"}
NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
SLURM_SPECIAL_STEPS = 0xFFFFFFF0  # the batch, extern and interactive steps' ids lie above: not srun's tasks
IFNAME_OVERRIDE = "LLMJP_DS_SOCKET_IFNAME"
LAUNCHED_BY = {"Slurm": "srun", "openmpi": "mpirun", "pmi": "mpiexec", "launcher": "torchrun or deepspeed"}


@dataclass(frozen=True)
class JobEnv:
    source: str  # torchrun, deepspeed, openmpi, pmi, slurm, environment, single process
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int | None = None  # ranks on this node (None: unknown)
    num_nodes: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    nodes: tuple[str, ...] = ()  # the scheduler's hosts, when it lists them

    def describe(self) -> str:
        line = f"launch: {self.source}, world {self.world_size}, nodes {self.num_nodes}"
        return line + (f", master {self.master_addr}:{self.master_port}" if self.master_addr else "")


def _get(env: Mapping[str, str], key: str) -> str | None:
    """The value of ``key``, None when unset or blank."""
    value = (env.get(key) or "").strip()
    return value or None


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int | None:
    value = _get(env, key)
    if value is None:
        return default
    if not value.isdigit():
        fail(f"{key}={value!r} is not a whole number (a hand-made export?): unset it, or let the launcher set it")
    return int(value)


def _check_rank(rank_key: str, rank: int, size_key: str, size: int, what: str) -> None:
    if not rank < size:
        fail(f"{rank_key}={rank} is not below {size_key}={size}: the {what} environment contradicts itself "
             f"(variables exported by hand, or left from another job?); unset the stale ones and start the tasks "
             f"with {LAUNCHED_BY[what]}, which sets them")


def detect(env: Mapping[str, str] | None = None) -> JobEnv:
    """This process's place in its job (module docstring: sources, precedence, contradictions)."""
    env = os.environ if env is None else env
    if any(_get(env, k) for k in ("TORCHELASTIC_RUN_ID", "CROSS_RANK", "LOCAL_SIZE")):
        return _launcher(env)
    scheduler = _mpi(env, "openmpi") or _pmi_or_slurm(env)
    if scheduler is not None:
        return _reconcile(env, scheduler)
    if _get(env, "RANK") or _get(env, "WORLD_SIZE"):
        return _launcher(env)
    return JobEnv("single process")


def _launcher(env: Mapping[str, str]) -> JobEnv:
    source = ("torchrun" if _get(env, "TORCHELASTIC_RUN_ID") else "deepspeed" if
              _get(env, "CROSS_RANK") or _get(env, "LOCAL_SIZE") else "environment")
    rank, world = _int(env, "RANK", 0), _int(env, "WORLD_SIZE", 1)
    _check_rank("RANK", rank, "WORLD_SIZE", world, "launcher")
    local = _int(env, "LOCAL_WORLD_SIZE") or _int(env, "LOCAL_SIZE")
    nodes = _int(env, "GROUP_WORLD_SIZE") or _int(env, "CROSS_SIZE") or (-(-world // local) if local else 1)
    return JobEnv(source, rank, world, _int(env, "LOCAL_RANK", 0), local, nodes, _get(env, "MASTER_ADDR"),
                  _int(env, "MASTER_PORT"))


def _reconcile(env: Mapping[str, str], job: JobEnv) -> JobEnv:
    """RANK / WORLD_SIZE without a launcher's marker, checked against the scheduler's ``job``."""
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if rank is None and world is None:
        return job
    rank_key, size_key = SCHEDULER_KEYS[job.source]
    if rank is not None and world is not None and world > job.world_size:
        return _launcher(env)  # a launcher running several workers per task numbered them
    fix = f"unset RANK and WORLD_SIZE ({job.source} gives this task its place)"
    if world is None:
        fail(f"RANK={rank} is set without WORLD_SIZE (a stale export?) in a {job.source} task ({rank_key}="
             f"{job.rank} of {size_key}={job.world_size}): {fix}")
    if world != job.world_size:
        fail(f"WORLD_SIZE={world} (a stale export?) contradicts {size_key}={job.world_size}: {fix}")
    if rank is not None and rank != job.rank:
        fail(f"RANK={rank} (a stale export?) contradicts {rank_key}={job.rank} (both in a world of {world}): {fix}")
    return job


def _mpi(env: Mapping[str, str], source: str) -> JobEnv | None:
    rank_key, size_key, local_key, local_size_key = MPI_KEYS[source]
    if _get(env, rank_key) is None or _get(env, size_key) is None:
        return None
    rank, world = _int(env, rank_key), _int(env, size_key)
    _check_rank(rank_key, rank, size_key, world, source)
    if world == 1:
        return JobEnv(source, rank, world, 0, 1)
    local_rank, local_size = _int(env, local_key), _int(env, local_size_key)
    if local_rank is None or local_size is None:
        fail(f"{rank_key} is set but {local_key} or {local_size_key} is not: this rank's place on its node (its GPU) "
             f"is unknown; start the ranks with the MPI launcher, which sets them")
    _check_rank(local_key, local_rank, local_size_key, local_size, source)
    addr, port = _get(env, "MASTER_ADDR"), _int(env, "MASTER_PORT")
    nodes: tuple[str, ...] = ()
    job_list = next(((k, _get(env, k)) for k in NODELISTS[1:] if _get(env, k)), None)
    if job_list and (addr is None or port is None):  # inside a Slurm job: its first node and id (LLM-jp's rule)
        nodes = tuple(hostnames(*job_list))
        addr, port = addr or nodes[0], port or slurm_port(env)
    if addr is None or port is None:
        missing = " and ".join(k for k, v in (("MASTER_ADDR", addr), ("MASTER_PORT", port)) if v is None)
        fail(f"{source} rank {rank} of {world} ({rank_key}) has no {missing}: MPI launchers give no rendezvous "
             f"address; pass {MASTER_FLAGS[source]}, or run inside a Slurm job (its first node and job id give both)")
    return JobEnv(source, rank, world, local_rank, local_size, -(-world // local_size), addr, port, nodes)


def _pmi_or_slurm(env: Mapping[str, str]) -> JobEnv | None:
    step = _get(env, "SLURM_STEP_ID") or _get(env, "SLURM_STEPID")
    in_step = (_get(env, "SLURM_PROCID") is not None and step is not None and step.isdigit()
               and int(step) < SLURM_SPECIAL_STEPS)
    pmi_size = _int(env, "PMI_SIZE") if _get(env, "PMI_RANK") else None
    if pmi_size is not None and not (in_step and _int(env, "SLURM_NTASKS") == pmi_size):
        return _mpi(env, "pmi")  # mpiexec (inside Slurm its proxies' step has one task per node)
    if not in_step:
        return None
    job = _slurm(env)
    if pmi_size is not None and _int(env, "PMI_RANK") != job.rank:
        fail(f"PMI_RANK={_int(env, 'PMI_RANK')} contradicts SLURM_PROCID={job.rank} in a step of {job.world_size} "
             "tasks: unset the stale PMI_RANK")
    return job


def _slurm(env: Mapping[str, str]) -> JobEnv:
    rank = _int(env, "SLURM_PROCID")
    world = _int(env, "SLURM_NTASKS") or _int(env, "SLURM_NPROCS") or _int(env, "SLURM_STEP_NUM_TASKS")
    if world is None:
        fail(f"SLURM_PROCID={rank} is set without SLURM_NTASKS: the Slurm environment is incomplete (exported by "
             "hand?); start the tasks with srun, which sets both")
    _check_rank("SLURM_PROCID", rank, "SLURM_NTASKS", world, "Slurm")
    if world == 1:
        return JobEnv("slurm", 0, 1, 0, 1)
    var = next((k for k in NODELISTS if _get(env, k)), None)
    if var is None:
        fail(f"a Slurm step of {world} tasks without SLURM_JOB_NODELIST: the Slurm environment is incomplete "
             "(exported by hand?); start the tasks with srun")
    nodes = tuple(hostnames(var, _get(env, var)))
    tasks = _tasks_per_node(env, var, len(nodes), world)
    node = _int(env, "SLURM_NODEID")
    if node is not None and node >= len(nodes):
        fail(f"SLURM_NODEID={node} is not below the {len(nodes)} nodes of {var}: the Slurm environment contradicts "
             "itself (exported by hand, or left from another job?); unset the stale ones")
    known = tasks and (node is not None or len(set(tasks)) == 1)  # uneven nodes need this one's index
    local_size = tasks[node or 0] if known else None
    local_rank = _int(env, "SLURM_LOCALID", rank if len(nodes) == 1 else None)
    if local_rank is None:
        fail("a Slurm task without SLURM_LOCALID on a step over several nodes: its GPU is unknown; start the "
             "tasks with srun, which sets it")
    if local_size is not None:
        _check_rank("SLURM_LOCALID", local_rank, "this node's task count", local_size, "Slurm")
    addr = _get(env, "MASTER_ADDR")
    hosts = tuple(dict.fromkeys(nodes))
    if addr and _is_loopback(addr) and len(hosts) > 1:
        fail(f"MASTER_ADDR={addr} (a stale export?) is a loopback address, but the Slurm step spans {len(hosts)} "
             f"nodes ({hosts[0]}, {hosts[1]}, ...): unset MASTER_ADDR (the first node, {hosts[0]}, is used)")
    return JobEnv("slurm", rank, world, local_rank, local_size, len(hosts), addr or nodes[0],
                  _int(env, "MASTER_PORT") or slurm_port(env), nodes)


def _tasks_per_node(env: Mapping[str, str], var: str, n_nodes: int, world: int) -> list[int] | None:
    """Tasks on each node of the list, checked against it and the world (None: unknown)."""
    key = next((k for k in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if _get(env, k)), None)
    if key is not None:
        try:
            tasks = expand_tasks_per_node(_get(env, key))
        except HostlistError as exc:
            fail(f"{key}={_get(env, key)!r} cannot be parsed ({exc}): fix or unset it (a hand-made export?)")
        text = f"{key}={_get(env, key)}"
    elif _int(env, "SLURM_NTASKS_PER_NODE"):
        per = _int(env, "SLURM_NTASKS_PER_NODE")
        tasks, text = [per] * n_nodes, f"SLURM_NTASKS_PER_NODE={per}"
    else:
        return [world] if n_nodes == 1 else None
    if len(tasks) != n_nodes:
        fail(f"{text} counts {len(tasks)} nodes but {var} lists {n_nodes}: the Slurm environment contradicts itself "
             "(exported by hand, or left from another job?); unset the stale ones")
    if sum(tasks) != world:
        fail(f"{text} adds up to {sum(tasks)} tasks but SLURM_NTASKS={world}: the Slurm environment contradicts "
             "itself (exported by hand, or left from another job?); unset the stale ones")
    return tasks


def slurm_port(env: Mapping[str, str]) -> int:
    """LLM-jp's sbatch rule: 10000 + SLURM_JOB_ID % 50000 (each job its own port, the same on every node)."""
    job = _int(env, "SLURM_JOB_ID") or _int(env, "SLURM_JOBID")
    if job is None:
        fail("no SLURM_JOB_ID to derive the rendezvous port from (10000 + job id % 50000): set MASTER_PORT")
    return 10000 + job % 50000


def hostnames(var: str, text: str) -> list[str]:
    """The hosts of Slurm hostlist ``text`` (from variable ``var``); ``scontrol show hostnames`` only where our
    parser cannot read it; one line naming the variable where neither can."""
    try:
        return expand_hostlist(text)
    except HostlistError as exc:
        reason = str(exc)
    names = _scontrol_hostnames(text)
    if names:
        return names
    shown = text if len(text) <= 120 else text[:117] + "..."
    fail(f"{var}={shown!r} cannot be parsed as a Slurm hostlist ({reason}): fix or unset it (a hand-made "
         f"export?); `scontrol show hostnames` prints how Slurm reads a nodelist")


def _scontrol_hostnames(text: str) -> list[str] | None:
    exe = shutil.which("scontrol")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "show", "hostnames", text], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.split() if out.returncode == 0 and out.stdout.strip() else None


def _is_loopback(addr: str) -> bool:
    """A loopback address written as such (no name lookup): 127.x, ::1, localhost."""
    if addr.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def export(job: JobEnv, environ: MutableMapping[str, str] = os.environ) -> None:
    """Write a scheduler's decision as torchrun's variables (a launcher's own and one-process worlds: nothing)."""
    if job.source in KEPT or job.world_size == 1:
        return
    environ.update(RANK=str(job.rank), WORLD_SIZE=str(job.world_size), LOCAL_RANK=str(job.local_rank),
                   MASTER_ADDR=str(job.master_addr), MASTER_PORT=str(job.master_port))
    if job.local_world_size is not None:
        environ["LOCAL_WORLD_SIZE"] = str(job.local_world_size)
    else:
        environ.pop("LOCAL_WORLD_SIZE", None)


# --- the network interface a rank advertises ---------------------------------------------------------------

def interface_of(address: str) -> str | None:
    """The interface of this host that holds ``address`` (psutil.net_if_addrs), or None."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addrs):
            return name
    return None


def route_interface(addr: str, port: int) -> tuple[str, str | None]:
    """(local address, interface) of this host's route to ``addr``: connecting a UDP socket picks the route and
    sends nothing."""
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        local = s.getsockname()[0]
    return local, interface_of(local)


def choose_interface(master_addr: str, port: int, others=(), env: Mapping[str, str] = os.environ) -> str | None:
    """The interface this rank should advertise: LLMJP_DS_SOCKET_IFNAME, else GLOO_SOCKET_IFNAME or
    NCCL_SOCKET_IFNAME when one names an interface of this host, else the route's to the master, or (on the master,
    whose route to itself may be loopback) to the first of ``others`` with a route that is not; None if none."""
    names = psutil.net_if_addrs()
    override = _get(env, IFNAME_OVERRIDE)
    if override:
        if override not in names:
            fail(f"{IFNAME_OVERRIDE}={override} names no interface of {socket.gethostname()} ({', '.join(names)}): "
                 "name one of them, or unset it to take the route to the master's")
        return override
    named = next((v for v in (_get(env, "GLOO_SOCKET_IFNAME"), _get(env, "NCCL_SOCKET_IFNAME")) if v in names), None)
    if named:
        return named
    for addr in dict.fromkeys((master_addr, *others)):
        try:
            local, name = route_interface(addr, port)
        except OSError as exc:
            if addr == master_addr:
                fail(f"MASTER_ADDR {addr} does not resolve or route on {socket.gethostname()} ({exc}): set "
                     "MASTER_ADDR to an address every node reaches")
            continue
        if name and not ipaddress.ip_address(local).is_loopback:
            return name
    return None


def set_socket_interface(job: JobEnv, environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Over several nodes: GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME, where unset, name the interface of
    :func:`choose_interface`; returns it (None: one node, or no interface found; nothing changed)."""
    if job.num_nodes <= 1 or not job.master_addr or job.master_port is None:
        return None
    return set_socket_interface_to(job.master_addr, job.master_port,
                                   [n for n in job.nodes if n != job.master_addr], environ)


def set_socket_interface_to(master_addr: str, port: int, others, environ: MutableMapping[str, str] = os.environ
                            ) -> str | None:
    """GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME, where unset, name the interface :func:`choose_interface` finds
    towards the master or ``others`` (hosts of the job); after the rendezvous ``others`` are the other hosts'
    addresses, which the master's host needs when the launcher named no hosts (the deepspeed launcher)."""
    name = choose_interface(master_addr, port, others, environ)
    for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if name and not _get(environ, key):
            environ[key] = name
    return name


def prepare_launch(environ: MutableMapping[str, str] = os.environ) -> JobEnv:
    """Decide this process's place, export it and the socket interface (call before the world size is read)."""
    job = detect(environ)
    export(job, environ)
    set_socket_interface(job, environ)
    return job
