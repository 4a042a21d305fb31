"""The process that launched this rank: noticing that it is gone, and saying who holds a rendezvous port.

**Launcher death.** ``deepspeed ...`` is DeepSpeed's runner (``launcher/runner.py``); on one node it starts
``python -m deepspeed.launcher.launch``, which starts the ranks (on several nodes pdsh starts one ``launch`` per
node). A SIGTERM to the runner's pid alone ends the runner at once: it installs no handler on that path, so
nothing reaches ``launch`` or the ranks, and a rank would train on unattended, holding its GPU and the port.
torchrun's agent forwards SIGTERM to its workers (each in its own session, so a signal to torchrun's process
group does not reach them), but a SIGKILL of the agent leaves them alone too.

:func:`identify` (called once when torch.distributed starts; the :class:`ParallelContext` keeps the result) walks up
from this process's parent while the processes are launchers, recognised by their command line (the DeepSpeed
runner, ``deepspeed.launcher.launch``, torchrun / ``torch.distributed.run``), and keeps each one's pid and ``/proc``
start time, so that a reused pid is not taken for the launcher. The walk stops at the first process that is not a
launcher: the user's shell, nohup, sshd, a scheduler's step daemon are never watched (a shell that exits under nohup
does not stop a run). When the parent is DeepSpeed's ``launch`` (which starts its ranks from its main thread), the
kernel also sends this process SIGTERM when it dies (``PR_SET_PDEATHSIG``). :func:`watch` starts a thread that
notices any of them gone (exited, killed, a zombie) and calls back: the trainer then stops exactly as on its own
SIGTERM (save at the step boundary, every rank together, exit 0). Under a plain ``python -m llmjp_ds.train`` there
is no launcher and nothing is watched.

**A lost host's ssh session.** Over several hosts the deepspeed runner starts every host's ``launch`` with pdsh,
one ssh session per host, and waits for pdsh, which waits for every session. A session to a host that went
silent (power lost, link down) ends only when ssh's keepalive gives up, and ssh has none by default: the
``deepspeed`` command would outlive the job by as long as TCP waits. When the job ends for a lost host,
:func:`end_launch_sessions`, run by each rank that ends it, sends SIGTERM to that host's ssh session where this
host holds it (the host the user typed ``deepspeed`` on): pdsh's children whose remote command is this job's
``launch`` (its ``--world_info`` and ``--master_port``, read from this rank's own ``launch``) for the lost
host's node (``--node_rank``). pdsh then reports that session's end and exits non-zero, and the runner with it.
Open MPI's mpirun is stuck the same way: aborting the job, it waits for the silent host's daemon, whose TCP
connection retransmits for ~15 minutes, and a SIGTERM does not end it. When the rank's parent is mpirun, the
rank interrupts it twice: the second SIGINT makes mpirun end at once, which ends the daemons of the other hosts
and their ranks, and the batch script's ``wait`` with a non-zero status. The session that its parent (mpirun, or
a daemon that started others) holds to that host (``ssh HOST ... orted ...``) is ended too: left behind, it
would keep the job's processes alive.

**A port in use.** :func:`port_in_use_message` names the port, the host, the process listening on it (from
``psutil.net_connections``, when this user may see it) and how to choose another.
"""

from __future__ import annotations

import base64
import binascii
import ctypes
import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

POLL_S = 0.5  # how often the watcher looks at the launchers
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Launcher:
    pid: int
    start_time: int  # /proc/<pid>/stat field 22 (clock ticks since boot): a reused pid has another
    kind: str  # "deepspeed runner", "deepspeed launch", "torchrun"

    def describe(self) -> str:
        return f"the {self.kind} (pid {self.pid})"


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of ``pid`` from /proc, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # after "pid (comm) ": comm may hold spaces and parentheses
    return fields[0], int(fields[1]), int(fields[19])


def _cmdline(pid: int) -> list[str]:
    try:
        return [a for a in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0") if a]
    except OSError:
        return []


MODULES = {"deepspeed.launcher.launch": "deepspeed launch", "deepspeed.launcher.runner": "deepspeed runner",
           "torch.distributed.run": "torchrun", "torch.distributed.launch": "torchrun"}
SCRIPTS = {"deepspeed/launcher/launch.py": "deepspeed launch", "deepspeed/launcher/runner.py": "deepspeed runner",
           "torch/distributed/run.py": "torchrun", "torch/distributed/launch.py": "torchrun"}
ENTRY_POINTS = {"deepspeed": "deepspeed runner", "ds": "deepspeed runner", "torchrun": "torchrun"}


def launcher_kind(argv: list[str]) -> str | None:
    """Which launcher a command line runs (None: not a launcher): ``[python [options]] -m MODULE`` or
    ``[python [options]] SCRIPT`` of DeepSpeed's runner or launch, or torchrun."""
    if not argv:
        return None
    args = argv[1:] if os.path.basename(argv[0]).startswith("python") else argv
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] not in ("-m", "-c"):
        i += 2 if args[i] in ("-X", "-W", "-Q") else 1  # the interpreter's own options (-u, -X dev, ...)
    if i >= len(args) or args[i] == "-c":
        return None
    if args[i] == "-m":
        return MODULES.get(args[i + 1] if i + 1 < len(args) else "")
    script = args[i]
    return ENTRY_POINTS.get(os.path.basename(script)) or next(
        (kind for tail, kind in SCRIPTS.items() if script.endswith("/" + tail) or script == tail), None)


def find_launchers(pid: int | None = None) -> list[Launcher]:
    """The launchers above ``pid`` (default: this process), nearest first, up to the first non-launcher."""
    chain: list[Launcher] = []
    info = _stat(pid or os.getpid())
    parent = info[1] if info else 0
    while parent > 1:
        info = _stat(parent)
        kind = launcher_kind(_cmdline(parent)) if info else None
        if info is None or kind is None or info[0] in "ZX":
            break
        chain.append(Launcher(parent, info[2], kind))
        parent = info[1]
    return chain


def alive(launcher: Launcher) -> bool:
    info = _stat(launcher.pid)
    return info is not None and info[2] == launcher.start_time and info[0] not in "ZX"


def identify() -> list[Launcher]:
    """This process's launchers (call it once, at startup, while they are surely alive); arms
    ``PR_SET_PDEATHSIG`` (SIGTERM) when the parent is DeepSpeed's ``launch``."""
    launchers = find_launchers() if sys.platform.startswith("linux") else []
    if launchers and launchers[0].kind == "deepspeed launch":
        _set_parent_death_signal(launchers[0])
    return launchers


def _set_parent_death_signal(parent: Launcher) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent.pid:  # it died before prctl: the kernel will not send the signal now
        os.kill(os.getpid(), signal.SIGTERM)


class LauncherWatch:
    """A daemon thread that calls ``on_gone(launcher)`` once, when one of ``launchers`` is gone."""

    def __init__(self, launchers: list[Launcher], on_gone: Callable[[Launcher], None], poll_s: float = POLL_S):
        self.launchers, self.on_gone, self.poll_s = launchers, on_gone, poll_s
        self.gone: Launcher | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmjp-ds-launcher-watch", daemon=True)
        self._thread.start()

    def check(self) -> Launcher | None:
        """The first launcher found gone (the parent counts as gone once this process has another parent)."""
        if self.launchers and os.getppid() != self.launchers[0].pid:
            return self.launchers[0]
        return next((launcher for launcher in self.launchers if not alive(launcher)), None)

    def _run(self) -> None:
        while not self._stop.is_set():
            gone = self.check()
            if gone is not None:
                self.gone = gone
                self.on_gone(gone)
                return
            self._stop.wait(self.poll_s)

    def close(self) -> None:
        self._stop.set()


def watch(launchers: list[Launcher], on_gone: Callable[[Launcher], None]) -> LauncherWatch | None:
    """Watch ``launchers`` (None when there are none: a plain ``python -m llmjp_ds.train``)."""
    return LauncherWatch(launchers, on_gone) if launchers else None


# --- the launcher's session to a lost host ------------------------------------------------------------------

def _flag(argv: list[str], name: str) -> str | None:
    """The value of ``name=VALUE`` in ``argv``, or None."""
    return next((a[len(name) + 1:] for a in argv if a.startswith(name + "=")), None)


def launch_world(argv: list[str]) -> tuple[str, str, list[int]] | None:
    """(``--world_info``, ``--master_port``, ranks of each node in node order) of a deepspeed ``launch`` command
    line; None when it has no world info (another launcher)."""
    info, port = _flag(argv, "--world_info"), _flag(argv, "--master_port")
    if not info or not port:
        return None
    try:
        nodes = json.loads(base64.urlsafe_b64decode(info))
    except (binascii.Error, ValueError):
        return None
    if not isinstance(nodes, dict) or not all(isinstance(slots, list) for slots in nodes.values()):
        return None
    return info, port, [len(slots) for slots in nodes.values()]


def nodes_of(ranks, sizes: list[int]) -> list[int]:
    """The node indices (``--node_rank``) holding ``ranks`` when node i runs the next ``sizes[i]`` ranks."""
    nodes, first = [], 0
    for node, size in enumerate(sizes):
        if any(first <= r < first + size for r in ranks):
            nodes.append(node)
        first += size
    return nodes


def _own_processes() -> list[int]:
    uid = os.getuid()
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and entry.stat().st_uid == uid:
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _pdsh_sessions(launchers: list[Launcher], ranks) -> list[int]:
    """The deepspeed launcher: pdsh's ssh children (anywhere on this host) whose remote command is this job's
    ``launch`` for a node of ``ranks``."""
    launch = next((launcher for launcher in launchers if launcher.kind == "deepspeed launch"), None)
    world = launch_world(_cmdline(launch.pid)) if launch is not None else None
    if world is None:
        return []
    info, port, sizes = world
    wanted = [(f"--world_info={info}", f"--node_rank={node} ", f"--master_port={port}")
              for node in nodes_of(ranks, sizes)]
    mine = {os.getpid(), *(launcher.pid for launcher in launchers)}
    found = []
    for pid in _own_processes():
        argv = _cmdline(pid)
        line = " ".join(argv) + " "
        if pid not in mine and not launcher_kind(argv) and any(all(m in line for m in marks) for marks in wanted):
            found.append(pid)
    return found


MPI_LAUNCHERS = ("mpirun", "mpiexec", "orterun", "prterun")
MPI_DAEMONS = (*MPI_LAUNCHERS, "orted", "prted")  # what a rank's parent is under Open MPI


def _parent_program() -> tuple[int, str]:
    """(pid, program name) of this process's parent ("" when /proc does not say)."""
    parent = os.getppid()
    argv = _cmdline(parent)
    return parent, os.path.basename(argv[0]) if argv else ""


def _mpi_sessions(members) -> list[int]:
    """Open MPI: the sessions (``ssh HOST ... orted ...``) to the hosts of ``members`` that this rank's parent holds
    (mpirun on the first host, or a daemon that started further daemons)."""
    parent, program = _parent_program()
    if program not in MPI_DAEMONS:
        return []
    names = {name for m in members for name in (m.host, m.host.split(".")[0], m.addr)}
    found = []
    for pid in _own_processes():
        info, child = _stat(pid), _cmdline(pid)
        if info and info[1] == parent and names & set(child) and any("orted" in a for a in child):
            found.append(pid)
    return found


def end_launch_sessions(launchers: list[Launcher], lost: dict) -> list[int]:
    """Interrupt this rank's mpirun twice, then SIGTERM each process of this host (this user's) that holds the
    launcher's session to the silent host of ``lost`` ({rank: member with ``host`` and ``addr``}; module
    docstring); the pids signalled."""
    sessions = _pdsh_sessions(launchers, list(lost)) + _mpi_sessions(lost.values())  # while mpirun is their parent
    ended = []
    parent, program = _parent_program()
    if program in MPI_LAUNCHERS:
        time.sleep(0.5)  # mpirun forwards the line this rank printed before it ends
        try:
            os.kill(parent, signal.SIGINT)  # mpirun starts aborting the job ...
            time.sleep(0.2)
            os.kill(parent, signal.SIGINT)  # ... and, interrupted again, ends without waiting for every daemon
            ended.append(parent)
        except OSError:
            pass
    for pid in sessions:
        try:
            os.kill(pid, signal.SIGTERM)
            ended.append(pid)
        except OSError:
            pass
    return ended


# --- a rendezvous port in use ------------------------------------------------------------------------------

def is_address_in_use(exc: BaseException) -> bool:
    text = str(exc)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def port_holders(port: int) -> list[tuple[int, str]]:
    """(pid, command line) of each process listening on TCP ``port`` here that this user can see."""
    try:
        import psutil

        conns = psutil.net_connections(kind="tcp")
    except Exception:  # psutil missing, or not allowed to list sockets
        return []
    pids = sorted({c.pid for c in conns if c.laddr and c.laddr.port == port and c.status == "LISTEN" and c.pid})
    return [(pid, " ".join(_cmdline(pid))) for pid in pids]


def port_in_use_message(addr: str, port: int) -> str:
    """One line: the port, the host, who holds it (if visible) and how to choose another."""
    holders = port_holders(port)
    host = socket.gethostname()
    where = f"{addr} ({host})" if addr not in (host, "") else host
    if holders:
        held = "it is held by " + ", ".join(
            f"pid {pid}" + (f" ({cmd[:160]}{'...' if len(cmd) > 160 else ''})" if cmd else "") for pid, cmd in holders)
        end = f"end it (kill {' '.join(str(pid) for pid, _ in holders)}) if it is a stale run, "
    else:
        held, end = "its holder is not visible to this user", "end the stale process, "
    return (f"the rendezvous port {port} on {where} is in use: {held}; {end}or choose another port: "
            f"`deepspeed --master_port N ...`, `torchrun --master-port N ...`, or MASTER_PORT=N")


def check_port_free(port: int) -> bool:
    """Whether a listening socket could be bound on ``port`` (as TCPStore's server does: all addresses,
    SO_REUSEADDR, so a port in TIME_WAIT counts as free)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True
