"""A DeepSpeed hostfile (``<host> slots=<N>`` a line) from a scheduler's allocation, for ``llmjp-ds preflight
--write-hostfile PATH [--slots N]`` in a batch script. The first of these that is set is read:

* ``$PE_HOSTFILE`` (SGE, Univa, Altair GE; ABCI): a line per host and queue, ``host slots queue processors``;
  a host's slots are summed. LLM-jp's ABCI scripts build their hostfile from it.
* ``$PBS_NODEFILE`` (PBS Pro, OpenPBS, Torque): a line per slot, the host repeated; slots are the repeats.
* ``$SLURM_JOB_NODELIST`` (or ``$SLURM_NODELIST``), e.g. ``node[01-04]``: slots from ``SLURM_NTASKS_PER_NODE``
  (``--ntasks-per-node``), else ``SLURM_TASKS_PER_NODE`` (e.g. ``8(x4)``).

``--slots N`` gives every host N slots (SGE and PBS may count CPU slots, the launcher wants GPUs); under Slurm it
must agree with an explicit ``--ntasks-per-node``. The file is written atomically (a temp file beside it, then
``os.replace``), so a launcher never reads half of it; preflight then checks it by the launcher's own rule.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Mapping

from llmjp_ds.errors import fail
from llmjp_ds.io_utils import write_bytes_atomic
from llmjp_ds.launch.hostlist import HostlistError, expand_tasks_per_node
from llmjp_ds.launch.scheduler import hostnames

SOURCES = (("PE_HOSTFILE", "SGE"), ("PBS_NODEFILE", "PBS"), ("SLURM_JOB_NODELIST", "Slurm"),
           ("SLURM_NODELIST", "Slurm"))
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _value(env: Mapping[str, str], key: str) -> str | None:
    value = (env.get(key) or "").strip()
    return value or None


def _lines(var: str, path: str) -> list[str]:
    try:
        return Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        fail(f"cannot read ${var} {path} ({exc.strerror or exc}): run this inside the job (its batch script), on "
             "the node where the scheduler wrote that file, or unset the stale variable")
    except UnicodeDecodeError:
        fail(f"${var} {path} is not a text file of host names: unset the stale variable, or point it at the "
             "scheduler's host file")


def _host(var: str, path: str, lineno: int, name: str) -> str:
    if not _HOST.fullmatch(name):
        fail(f"{path}:{lineno}: {name[:80]!r} is not a host name (read from ${var}): is the file the scheduler's?")
    return name


def pe_hostfile_hosts(path: str) -> dict[str, int]:
    """``{host: slots}`` of SGE's ``$PE_HOSTFILE`` (``host slots queue processors`` lines), in file order."""
    hosts: dict[str, int] = {}
    for lineno, line in enumerate(_lines("PE_HOSTFILE", path), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) < 2 or not fields[1].isdigit():
            fail(f"{path}:{lineno}: {line.strip()[:80]!r} is not SGE's 'host slots queue processors' "
                 "($PE_HOSTFILE): is the variable left from another job?")
        host = _host("PE_HOSTFILE", path, lineno, fields[0])
        hosts[host] = hosts.get(host, 0) + int(fields[1])
    return hosts


def pbs_nodefile_hosts(path: str) -> dict[str, int]:
    """``{host: slots}`` of PBS's ``$PBS_NODEFILE`` (a line per slot), in order of first appearance."""
    hosts: dict[str, int] = {}
    for lineno, line in enumerate(_lines("PBS_NODEFILE", path), 1):
        name = line.strip()
        if name and not name.startswith("#"):
            host = _host("PBS_NODEFILE", path, lineno, name)
            hosts[host] = hosts.get(host, 0) + 1
    return hosts


def slurm_hosts(env: Mapping[str, str], var: str, slots: int | None) -> dict[str, int]:
    """``{host: slots}`` of a Slurm nodelist: ``slots``, else the tasks per node the job asked for."""
    nodes = list(dict.fromkeys(hostnames(var, _value(env, var))))
    per_node = _value(env, "SLURM_NTASKS_PER_NODE")
    if per_node is not None and not per_node.isdigit():
        fail(f"SLURM_NTASKS_PER_NODE={per_node!r} is not a whole number: unset it, or let sbatch set it")
    if slots is not None and per_node is not None and slots != int(per_node):
        fail(f"--slots {slots} disagrees with SLURM_NTASKS_PER_NODE={per_node} (the job's --ntasks-per-node): pass "
             f"--slots {per_node}, or leave --slots out")
    if slots or per_node:
        return {node: slots or int(per_node) for node in nodes}
    tasks_text = _value(env, "SLURM_TASKS_PER_NODE")
    if tasks_text is None:
        fail(f"${var} lists {len(nodes)} hosts but no slots are known (no SLURM_NTASKS_PER_NODE or "
             "SLURM_TASKS_PER_NODE): pass --slots N (GPUs per host)")
    try:
        tasks = expand_tasks_per_node(tasks_text)
    except HostlistError as exc:
        fail(f"SLURM_TASKS_PER_NODE={tasks_text!r} cannot be parsed ({exc}): pass --slots N (GPUs per host)")
    if len(tasks) != len(nodes):
        fail(f"SLURM_TASKS_PER_NODE={tasks_text} counts {len(tasks)} nodes but ${var} lists {len(nodes)}: the Slurm "
             "environment contradicts itself; pass --slots N (GPUs per host)")
    return dict(zip(nodes, tasks))


def allocation_hosts(env: Mapping[str, str], slots: int | None = None) -> tuple[str, dict[str, int]]:
    """(the variable read, ``{host: slots}``) of the scheduler's allocation in ``env``."""
    if slots is not None and slots < 1:
        fail(f"--slots {slots}: a host needs at least 1 slot (its GPU count)")
    var = next((key for key, _ in SOURCES if _value(env, key)), None)
    if var is None:
        fail("--write-hostfile: none of $PE_HOSTFILE (SGE), $PBS_NODEFILE (PBS) or $SLURM_JOB_NODELIST (Slurm) is "
             "set: run it inside the job's allocation (in its batch script), or write the hostfile by hand (see "
             "hostfiles/h100)")
    if var.startswith("SLURM"):
        return var, slurm_hosts(env, var, slots)
    path = _value(env, var)
    hosts = pe_hostfile_hosts(path) if var == "PE_HOSTFILE" else pbs_nodefile_hosts(path)
    if not hosts:
        fail(f"${var} {path} lists no hosts: is the variable left from another job?")
    return var, {host: slots or n for host, n in hosts.items()}


def hostfile_text(hosts: dict[str, int], origin: str) -> str:
    lines = [f"# written by llmjp-ds preflight --write-hostfile from {origin}"]
    return "\n".join(lines + [f"{host} slots={n}" for host, n in hosts.items()]) + "\n"


def write_hostfile(path: str | Path, env: Mapping[str, str] | None = None, slots: int | None = None) -> str:
    """Write the allocation's DeepSpeed hostfile to ``path`` atomically; returns a line saying what was written."""
    env = os.environ if env is None else env
    var, hosts = allocation_hosts(env, slots)
    path = Path(path)
    if path.is_dir():
        fail(f"--write-hostfile {path} is a directory: pass a file name, e.g. {path / 'hostfile'}")
    write_bytes_atomic(path, hostfile_text(hosts, f"${var}").encode())
    label = dict(SOURCES)[var]
    return f"wrote {path} from ${var} ({label}): {len(hosts)} hosts, {sum(hosts.values())} slots"
