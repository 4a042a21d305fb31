"""Hosts made of network namespaces on this machine, each with its own address, name and sshd, and a real Slurm
and a real Grid Engine on them: what the multi-host tests launch across.

:class:`NetHosts` makes ``n`` hosts ``node1 .. nodeN`` (and a ``login`` host, which runs no rank) joined by a
bridge in a namespace of its own, on a random 10.x.y.0/24 that exists only inside those namespaces (nothing is
sent anywhere else). Each host has:

* a network namespace (``ip netns``) with ``eth0`` on the bridge;
* its own host name and its own /etc/hosts and /etc/ssh, bound over the machine's in a mount namespace of its
  processes (``nsenter --net``, then ``unshare --mount --uts``; not ``ip netns exec``, whose fresh /sys hides
  the cgroup filesystem that slurmd needs): ``hosts`` maps the host's own name to 127.0.1.1 as Debian writes
  it, the others' names to their addresses; ``ssh_config`` has the key this fixture made and no host-key
  prompts, and otherwise ssh's defaults: no keepalive (``ServerAliveInterval`` 0), as users' machines have;
* an sshd listening inside it, which accepts that key for root.

:class:`Slurm` runs munged (its socket in the fixture's directory), a slurmctld on the first host and a slurmd
on each, from a generated slurm.conf (``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``).
:class:`GridEngine` runs a qmaster on the first host and an execd on each, from a cell of its own.

One pair of hosts, and one Slurm and one Grid Engine on them, serve the whole session (:func:`net_hosts`,
:func:`slurm_cluster`, :func:`gridengine_cluster`); before each test :meth:`NetHosts.reset` brings them back to
what they were made as: every scheduler's jobs cancelled, links up, /etc files rewritten, sshd running, and every
process in the hosts' namespaces but their daemons ended.

Everything is removed afterwards: the processes inside the namespaces (by namespace), the daemons (by the pids in
their pid files), the namespaces. Nothing is written outside the fixture's directory but sshd's /run/sshd. Without
root, ``ip netns`` or the tools, the tests skip with the reason.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

SSHD = "/usr/sbin/sshd"
PACKAGES = {"ip": "iproute2", SSHD: "openssh-server", "ssh": "openssh-client", "pdsh": "pdsh",
            "mpirun": "openmpi-bin", "slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client",
            "munged": "munge", "unshare": "util-linux", "sge_qmaster": "gridengine-master",
            "sge_execd": "gridengine-exec", "qsub": "gridengine-client", "qconf": "gridengine-client",
            "/usr/lib/gridengine/spoolinit": "gridengine-master"}


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=60)


def missing(*tools: str) -> str | None:
    """Why the multi-host tests cannot run here (None: they can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, sshd)"
    absent = [t for t in ("ip", "unshare", *tools) if shutil.which(t) is None and not Path(t).is_file()]
    if absent:
        return "not installed: " + ", ".join(f"{t} (Debian's {PACKAGES.get(t, t)})" for t in absent)
    probe = f"ljprobe{os.getpid()}"
    made = _sh("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"network namespaces are not available here ({made.stderr.strip()[:120]})"
    _sh("ip", "netns", "del", probe, check=False)
    return None


def _kill(pid: int, sig: int = signal.SIGKILL) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def _wait_until(done, timeout: float, failure, interval: float = 0.5) -> None:
    """Poll ``done()`` until it is true; RuntimeError(``failure()``) once ``timeout`` seconds have passed."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(failure())
        time.sleep(interval)


def _terminate(pidfiles) -> None:
    """SIGTERM to the daemon of each pid file (one gone, or a file never written, is skipped)."""
    for pidfile in pidfiles:
        try:
            os.kill(int(pidfile.read_text().strip()), signal.SIGTERM)
        except (OSError, ValueError):
            pass


class _Started:
    """A context manager that starts in ``_make`` and undoes in ``close`` (also when ``_make`` fails half-way)."""

    def __enter__(self):
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _make(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class NetHosts(_Started):
    """``n`` hosts of network namespaces with sshd; see the module docstring. A context manager."""

    def __init__(self, n: int, root: Path, login: bool = False):
        self.root = Path(root)
        self.tag = f"lj{random.randrange(16 ** 6):06x}"
        self.subnet = f"10.{random.randint(100, 250)}.{random.randint(0, 255)}"
        self.nodes = [f"node{i + 1}" for i in range(n)]  # what jobs run on
        self.names = [*self.nodes, *(["login"] if login else [])]  # and a login host, which runs none of a job
        self.addr = {name: f"{self.subnet}.{i + 1}" for i, name in enumerate(self.names)}
        self.ns = {name: f"{self.tag}-{name}" for name in self.names}
        self.veth = {name: f"{self.tag}v{i + 1}" for i, name in enumerate(self.names)}
        self.switch = f"{self.tag}-sw"
        self.key = self.root / "id_ed25519"
        self.sshd_pids: dict[str, int] = {}
        self.daemons: dict[str, set[int]] = {name: set() for name in self.names}  # what reset() leaves running
        self.schedulers: list = []  # each with reset(), which cancels its jobs (before reset() ends processes)

    # --- making and removing ------------------------------------------------------------------------------
    def _make(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key))
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.root / "host_key"))
        shutil.copy(f"{self.key}.pub", self.root / "authorized_keys")
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
        _sh("ip", "netns", "add", self.switch)
        _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for name in self.names:
            ns, veth = self.ns[name], self.veth[name]
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _sh("ip", "link", "set", veth, "netns", self.switch)
            _sh("ip", "-n", self.switch, "link", "set", veth, "master", "br0")
            _sh("ip", "-n", self.switch, "link", "set", veth, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.addr[name]}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            self._write_etc(name)
            self._start_sshd(name)
        for name in self.names:
            self._wait_for_port(self.names[0], self.addr[name], 22)

    def _write_etc(self, name: str) -> None:
        etc = self.etc(name)
        (etc / "ssh").mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost", f"127.0.1.1 {name}"]
        lines += [f"{self.addr[other]} {other}" for other in self.names if other != name]
        (etc / "hosts").write_text("\n".join(lines) + "\n")
        (etc / "ssh" / "ssh_config").write_text(
            f"Host *\n  IdentityFile {self.key}\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
            "  LogLevel ERROR\n  ConnectTimeout 10\n")  # no BatchMode: it would turn a 300 s keepalive on

    def _start_sshd(self, name: str) -> None:
        conf = self.root / f"sshd_{name}.conf"
        pidfile = self.root / f"sshd_{name}.pid"
        conf.write_text(f"ListenAddress 0.0.0.0\nHostKey {self.root / 'host_key'}\nPermitRootLogin yes\n"
                        f"AuthorizedKeysFile {self.root / 'authorized_keys'}\nStrictModes no\nUsePAM no\n"
                        f"PidFile {pidfile}\nPrintMotd no\nAcceptEnv *\n")
        pidfile.unlink(missing_ok=True)  # a restart: not the last sshd's number
        self.run(name, [SSHD, "-f", str(conf), "-E", str(self.root / f"sshd_{name}.log")], check=True)
        self.daemons[name].discard(self.sshd_pids.get(name))
        self.sshd_pids[name] = _pid_of(pidfile)
        self.daemons[name].add(self.sshd_pids[name])

    def _wait_for_port(self, from_host: str, addr: str, port: int, timeout: float = 10) -> None:
        probe = f"import socket; socket.create_connection(('{addr}', {port}), timeout=1).close()"
        _wait_until(lambda: self.run(from_host, ["python3", "-c", probe]).returncode == 0, timeout,
                    lambda: f"{addr}:{port} does not answer from {from_host}", interval=0.2)

    def pids(self, name: str) -> list[int]:
        out = _sh("ip", "netns", "pids", self.ns[name], check=False).stdout
        return [int(p) for p in out.split()]

    def close(self) -> None:
        for name in self.names:
            for pid in self.pids(name):
                _kill(pid)
        for ns in [*self.ns.values(), self.switch]:
            _sh("ip", "netns", "del", ns, check=False)
        self._remove_shared_memory()

    def _remove_shared_memory(self) -> None:
        """DeepSpeed's CPU all-reduce buffers (69 MB each) that the hosts' ranks left in the shared /dev/shm,
        named by their master's address: only ours carry this fixture's subnet."""
        for leftover in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{self.subnet}.*"):
            leftover.unlink(missing_ok=True)

    def reset(self) -> None:
        """Back to what :meth:`_make` made, between tests: every link up, the schedulers' jobs cancelled, the /etc
        files rewritten, every process in the hosts but their daemons ended (a test's leftovers), sshd running."""
        for name in self.names:
            _sh("ip", "-n", self.switch, "link", "set", self.veth[name], "up")
        for scheduler in self.schedulers:
            scheduler.reset()
        for name in self.names:
            self._write_etc(name)
            for pid in self.pids(name):
                if pid not in self.daemons[name]:
                    _kill(pid)
            if not _alive(self.sshd_pids[name]):
                self._start_sshd(name)
        self._remove_shared_memory()
        for name in self.names:
            self._wait_for_port(self.names[0], self.addr[name], 22)

    # --- using ----------------------------------------------------------------------------------------------
    def etc(self, name: str) -> Path:
        return self.root / "etc" / name

    def argv(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` run on host ``name``: in its network namespace, under its host name, with its /etc files."""
        etc = self.etc(name)
        setup = (f'hostname "$0" && mount --bind {etc}/hosts /etc/hosts && mount --bind {etc}/ssh /etc/ssh && '
                 'exec "$@"')
        return ["nsenter", f"--net=/run/netns/{self.ns[name]}", "unshare", "--mount", "--uts", "sh", "-c", setup,
                name, *map(str, argv)]

    def popen(self, name: str, argv: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(self.argv(name, argv), start_new_session=True, **kw)

    def run(self, name: str, argv: list[str], check: bool = False, timeout: float = 60, **kw):
        return subprocess.run(self.argv(name, argv), capture_output=True, text=True, check=check, timeout=timeout,
                              **kw)

    def cut(self, name: str) -> None:
        """Take ``name``'s link down: the host goes silent (its packets go nowhere), as when a node dies."""
        _sh("ip", "-n", self.switch, "link", "set", self.veth[name], "down")

    def power_off(self, name: str) -> list[int]:
        """``name`` silent as when it loses power: its link down, then every process on it but its daemons
        killed (those stay, unreachable, until :meth:`reset`); the pids killed."""
        self.cut(name)
        return [pid for pid in self.pids(name) if pid not in self.daemons[name] and _kill(pid)]

    def pids_of(self, name: str, pattern: str) -> list[int]:
        """The processes on ``name`` whose command line (its words joined by spaces) matches the regular expression
        ``pattern`` (``re.search``; never its sshd)."""
        found = []
        for pid in self.pids(name):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if re.search(pattern, cmdline) and pid != self.sshd_pids.get(name):
                found.append(pid)
        return found

    def end_processes(self, name: str, pattern: str, sig: int = signal.SIGKILL) -> list[int]:
        """Signal (default: SIGKILL) the processes on ``name`` of :meth:`pids_of`; their pids."""
        return [pid for pid in self.pids_of(name, pattern) if _kill(pid, sig)]


def _pid_of(pidfile: Path, timeout: float = 10) -> int:
    """The number in a daemon's pid file (which it may create before it writes the number)."""
    _wait_until(lambda: pidfile.is_file() and pidfile.read_text().strip(), timeout,
                lambda: f"{pidfile} holds no pid after {timeout} s", interval=0.05)
    return int(pidfile.read_text())


# how long a job step's credential lives, and so how long a requeued job waits before it may start again
# (slurm.conf's AuthInfo cred_expire; Slurm's default is 120 s). The schedulers then look every 1-2 s
# (SchedulerParameters; by default the backfill every 30 s and the main loop every 60 s): no event starts a job
# whose begin time has passed
CRED_EXPIRE_S = 10


class Slurm(_Started):
    """munged, a slurmctld on the first host and a slurmd on each host of ``hosts``. A context manager."""

    def __init__(self, hosts: NetHosts, root: Path):
        self.hosts, self.root = hosts, Path(root)
        self.conf = self.root / "slurm.conf"
        self.head = hosts.nodes[0]

    def _make(self) -> None:
        r = self.root
        for sub in ("state", "munge", *(f"spool-{n}" for n in self.hosts.nodes)):
            (r / sub).mkdir(parents=True, exist_ok=True)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        _sh("munged", "--force", f"--socket={r / 'munge' / 'munge.sock'}", f"--key-file={key}",
            f"--pid-file={r / 'munge' / 'munged.pid'}", f"--log-file={r / 'munge' / 'munged.log'}",
            f"--seed-file={r / 'munge' / 'munged.seed'}")
        nodes = "\n".join(f"NodeName={n} NodeAddr={self.hosts.addr[n]} CPUs=2 State=UNKNOWN" for n in self.hosts.nodes)
        self.conf.write_text(f"""ClusterName=llmjpds
SlurmctldHost={self.head}({self.hosts.addr[self.head]})
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r / 'munge' / 'munge.sock'},cred_expire={CRED_EXPIRE_S}
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r}/spool-%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd-%n.log
ReturnToService=2
SlurmdTimeout=300
KillWait=10
MinJobAge=30
SchedulerParameters=bf_interval=1,sched_interval=2
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:2
""")
        env = self.env()
        self.hosts.run(self.head, ["slurmctld", "-f", str(self.conf)], check=True, env=env)
        for name in self.hosts.nodes:
            self.hosts.run(name, ["slurmd", "-f", str(self.conf)], check=True, env=env)
        self.hosts.daemons[self.head].add(_pid_of(r / "slurmctld.pid"))
        for name in self.hosts.nodes:
            self.hosts.daemons[name].add(_pid_of(r / f"slurmd-{name}.pid"))
        self._wait_for_idle_nodes()
        self.hosts.schedulers.append(self)

    def _wait_for_idle_nodes(self, timeout: float = 60) -> None:
        states: dict[str, str] = {}

        def idle() -> bool:
            nonlocal states
            out = self.hosts.run(self.head, ["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env()).stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            return all(states.get(n) in ("idle", "mixed") for n in self.hosts.nodes)

        _wait_until(idle, timeout, lambda: f"Slurm's nodes are not idle: {states}\n{self.log_tail()}")

    def jobs(self) -> list[str]:
        return self.hosts.run(self.head, ["squeue", "-h", "-o", "%i"], env=self.env()).stdout.split()

    def reset(self) -> None:
        """Cancel every job and wait until every node is idle (a test that took a node away left it busy)."""
        jobs = self.jobs()
        if jobs:
            self.hosts.run(self.head, ["scancel", "--signal=KILL", *jobs], env=self.env())
            self.hosts.run(self.head, ["scancel", *jobs], env=self.env())
        _wait_until(lambda: not self.jobs(), 60, lambda: f"Slurm's jobs did not end: {self.log_tail()}")
        self._wait_for_idle_nodes()

    def env(self, **extra) -> dict:
        env = dict(os.environ, SLURM_CONF=str(self.conf))
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def log_tail(self, chars: int = 3000) -> str:
        logs = sorted(self.root.glob("slurm*.log"))
        return "\n".join(f"--- {p.name} ---\n{p.read_text(errors='replace')[-chars:]}" for p in logs)

    def close(self) -> None:
        if self in self.hosts.schedulers:
            self.hosts.schedulers.remove(self)
        _terminate([self.root / "slurmctld.pid", *self.root.glob("slurmd-*.pid"), self.root / "munge" / "munged.pid"])


SGE_BINARIES = Path("/var/lib/gridengine")  # Debian's SGE_ROOT: bin, lib, util, utilbin
SGE_QUEUE = """qname all.q
hostlist {hosts}
seq_no {seq_no}
load_thresholds NONE
suspend_thresholds NONE
nsuspend 1
suspend_interval 00:05:00
priority 0
min_cpu_interval 00:05:00
processors UNDEFINED
qtype BATCH INTERACTIVE
ckpt_list NONE
pe_list {pe}
rerun FALSE
slots 1
tmpdir /tmp
shell /bin/bash
prolog NONE
epilog NONE
shell_start_mode unix_behavior
starter_method NONE
suspend_method NONE
resume_method NONE
terminate_method NONE
notify {notify}
owner_list NONE
user_lists NONE
xuser_lists NONE
subordinate_list NONE
complex_values NONE
projects NONE
xprojects NONE
calendar NONE
initial_state default
""" + "".join(f"{kind}_{limit} INFINITY\n" for limit in ("rt", "cpu", "fsize", "data", "stack", "core", "rss", "vmem")
               for kind in "sh")
SGE_PE = """pe_name {pe}
slots 999
user_lists NONE
xuser_lists NONE
start_proc_args NONE
stop_proc_args NONE
allocation_rule $round_robin
control_slaves FALSE
job_is_first_task TRUE
urgency_slots min
accounting_summary FALSE
qsort_args NONE
"""


class GridEngine(_Started):
    """Son of Grid Engine 8.1.9 (Debian's gridengine-master, -exec, -client) on ``hosts``: a qmaster on the first
    node, an execd on each, a queue of one slot a node (node1 first) and a parallel environment with allocation_rule
    $round_robin: a job of 2 slots then spans both nodes (with 2 a node, a rerun that found node1 not yet free ran
    both ranks on node2). Its SGE_ROOT and cell are in the fixture's directory (Debian's binaries linked into it),
    spooled in plain files. The qmaster's own host reaches it from loopback, where its name resolves to 127.0.1.1
    as Debian writes /etc/hosts: the cell's host_aliases names that connection the host's. Root may run jobs
    (min_uid 0), the scheduler runs every second, and a job asked to stop with -notify gets SIGUSR2 :data:`NOTIFY`
    before SIGKILL."""

    PE = "llmjp"
    NOTIFY = "00:00:20"

    def __init__(self, hosts: NetHosts, root: Path):
        self.hosts, self.root = hosts, Path(root)
        self.sge_root, self.cell = self.root / "root", "cell"
        self.head = hosts.nodes[0]

    def env(self, **extra) -> dict:
        env = dict(os.environ, SGE_ROOT=str(self.sge_root), SGE_CELL=self.cell, SGE_QMASTER_PORT="6444",
                   SGE_EXECD_PORT="6445")
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def qconf(self, *args: str, text: str | None = None) -> None:
        """``qconf ARGS [FILE]`` on the first node; ``text``: the file's content."""
        if text is not None:
            conf = self.root / f"qconf-{len(list(self.root.glob('qconf-*')))}"
            conf.write_text(text)
            args = (*args, str(conf))
        done = self.hosts.run(self.head, ["qconf", *args], env=self.env())
        if done.returncode != 0:
            raise RuntimeError(f"qconf {' '.join(args)}: {done.stderr or done.stdout}")

    def _make(self) -> None:
        common = self.sge_root / self.cell / "common"
        common.mkdir(parents=True, exist_ok=True)
        for sub in ("bin", "lib", "util", "utilbin"):
            (self.sge_root / sub).symlink_to(SGE_BINARIES / sub)
        spool = self.root / "spool"
        for sub in ("qmaster", "execd"):
            (spool / sub).mkdir(parents=True, exist_ok=True)
        (common / "bootstrap").write_text(
            "admin_user none\ndefault_domain none\nignore_fqdn true\nspooling_method classic\n"
            f"spooling_lib libspoolc\nspooling_params {common};{spool / 'qmaster'}\nbinary_path /usr/sbin\n"
            f"qmaster_spool_dir {spool / 'qmaster'}\nsecurity_mode none\nlistener_threads 2\nworker_threads 2\n"
            "scheduler_threads 1\n")
        (common / "act_qmaster").write_text(self.head + "\n")
        (common / "host_aliases").write_text(f"{self.head} localhost\n")
        changes = {"execd_spool_dir": spool / "execd", "min_uid": 0, "min_gid": 0, "mailer": "/bin/true",
                   "shell_start_mode": "unix_behavior", "load_report_time": "00:00:05", "max_unheard": "00:00:30",
                   "execd_params": "ENABLE_ADDGRP_KILL=TRUE"}
        lines = [f"{line.split()[0]} {changes[line.split()[0]]}" if line.split() and line.split()[0] in changes
                 else line for line in Path("/usr/share/gridengine/default-configuration").read_text().splitlines()]
        (self.root / "configuration").write_text("\n".join(lines) + "\n")
        spooling = "/usr/lib/gridengine/spooldefaults"
        _sh("env", *(f"{k}={v}" for k, v in self.env().items() if k.startswith("SGE_")), "sh", "-c",
            f"/usr/lib/gridengine/spoolinit classic libspoolc '{common};{spool / 'qmaster'}' init && "
            f"{spooling} configuration {self.root / 'configuration'} && "
            f"{spooling} complexes /usr/share/gridengine/util/resources/centry && "
            f"{spooling} usersets /usr/share/gridengine/util/resources/usersets && {spooling} managers root")
        self.hosts.run(self.head, ["sge_qmaster"], check=True, env=self.env())
        self.hosts.daemons[self.head].add(_pid_of(spool / "qmaster" / "qmaster.pid"))
        _wait_until(lambda: self.hosts.run(self.head, ["qconf", "-sh"], env=self.env()).returncode == 0, 30,
                    lambda: f"sge_qmaster does not answer\n{self.log_tail()}")
        self._configure(spool)

    def _configure(self, spool: Path) -> None:
        sched = Path("/usr/share/gridengine/util/install_modules/inst_schedd_high.conf").read_text()
        for key, value in (("schedule_interval", "0:0:1"), ("flush_submit_sec", "1"), ("flush_finish_sec", "1"),
                           ("queue_sort_method", "seqno")):
            sched = re.sub(rf"^{key}\s.*$", f"{key} {value}", sched, flags=re.MULTILINE)
        self.qconf("-Msconf", text=sched)
        for name in self.hosts.nodes[1:]:
            self.qconf("-ah", name)
        for name in self.hosts.names:
            self.qconf("-as", name)
        self.qconf("-Ap", text=SGE_PE.format(pe=self.PE))
        for name in self.hosts.nodes:
            self.qconf("-Ae", text=f"hostname {name}\nload_scaling NONE\ncomplex_values NONE\nuser_lists NONE\n"
                                   "xuser_lists NONE\nprojects NONE\nxprojects NONE\nusage_scaling NONE\n"
                                   "report_variables NONE\n")
        seq_no = ",".join(["0", *(f"[{n}={i}]" for i, n in enumerate(self.hosts.nodes))])
        self.qconf("-Aq", text=SGE_QUEUE.format(hosts=" ".join(self.hosts.nodes), seq_no=seq_no, pe=self.PE,
                                                notify=self.NOTIFY))
        for name in self.hosts.nodes:
            self.hosts.run(name, ["sge_execd"], check=True, env=self.env())
            self.hosts.daemons[name].add(_pid_of(spool / "execd" / name / "execd.pid"))
        self._wait_for_queues()
        self.hosts.schedulers.append(self)

    def _wait_for_queues(self, timeout: float = 60) -> None:
        """Until every node's queue instance has reported its load, with no alarm, error or unknown state."""
        out = ""

        def ready() -> bool:
            nonlocal out
            out = self.hosts.run(self.head, ["qstat", "-f"], env=self.env()).stdout
            rows = [line.split() for line in out.splitlines() if line.startswith("all.q@")]
            return len(rows) == len(self.hosts.nodes) and all(len(r) == 5 and r[3] != "-NA-" for r in rows)

        _wait_until(ready, timeout, lambda: f"Grid Engine's queues are not ready:\n{out}\n{self.log_tail()}")

    def jobs(self) -> list[str]:
        out = self.hosts.run(self.head, ["qstat", "-u", "*"], env=self.env()).stdout
        return [line.split()[0] for line in out.splitlines()[2:] if line.strip()]

    def reset(self) -> None:
        """Delete every job, clear the queues' error states, and wait until both nodes report again."""
        jobs = self.jobs()
        if jobs:
            self.hosts.run(self.head, ["qdel", "-f", *jobs], env=self.env())
        _wait_until(lambda: not self.jobs(), 60, lambda: f"Grid Engine's jobs did not end: {self.log_tail()}")
        self.hosts.run(self.head, ["qmod", "-c", "*"], env=self.env())
        self._wait_for_queues()

    def log_tail(self, chars: int = 3000) -> str:
        logs = sorted((self.root / "spool").glob("*/messages")) + sorted((self.root / "spool").glob("execd/*/messages"))
        return "\n".join(f"--- {p} ---\n{p.read_text(errors='replace')[-chars:]}" for p in logs)

    def close(self) -> None:
        if self in self.hosts.schedulers:
            self.hosts.schedulers.remove(self)
        spool = self.root / "spool"
        _terminate([*spool.glob("execd/*/execd.pid"), spool / "qmaster" / "qmaster.pid"])


# --- the session's hosts and schedulers (registered in tests/conftest.py) ---------------------------------------

@pytest.fixture(scope="session")
def net_hosts(tmp_path_factory):
    """Two hosts and a login host for the whole session (tests take :func:`hosts`, which resets them first)."""
    reason = missing(SSHD, "ssh", "pdsh", "nsenter")
    if reason:
        pytest.skip(reason)
    with NetHosts(2, tmp_path_factory.mktemp("hosts"), login=True) as made:
        yield made


@pytest.fixture
def hosts(net_hosts):
    """The session's two hosts, as they were made (:meth:`NetHosts.reset`)."""
    net_hosts.reset()
    return net_hosts


def _session_scheduler(net_hosts: NetHosts, kind, *tools: str):
    reason = missing(*tools)
    if reason:
        pytest.skip(reason)
    with kind(net_hosts, net_hosts.root / kind.__name__.lower()) as made:
        yield made


@pytest.fixture(scope="session")
def slurm_cluster(net_hosts):
    yield from _session_scheduler(net_hosts, Slurm, "slurmctld", "slurmd", "sbatch", "munged")


@pytest.fixture
def slurm(hosts, slurm_cluster):
    """The session's Slurm on :func:`hosts`, no job queued (the hosts' reset cancelled them)."""
    return slurm_cluster


@pytest.fixture(scope="session")
def gridengine_cluster(net_hosts):
    yield from _session_scheduler(net_hosts, GridEngine, "sge_qmaster", "sge_execd", "qsub", "qconf",
                                  "/usr/lib/gridengine/spoolinit")


@pytest.fixture
def gridengine(hosts, gridengine_cluster):
    """The session's Grid Engine on :func:`hosts`, no job queued (the hosts' reset deleted them)."""
    return gridengine_cluster
