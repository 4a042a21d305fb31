"""The hosts of a DeepSpeed hostfile: the file read by the launcher's own rule (:func:`parse_hostfile`: ``<hostname>
slots=<N>`` a line, ``#`` comments, each host once; CRLF and tabs as the launcher takes them; a byte-order mark,
invisible or non-ASCII characters and bytes that are not UTF-8 refused, where the launcher would make a wrong host
name or a traceback of them), and the hosts as the launcher will reach them (:func:`check_hosts`: pdsh, name
resolution, ``ssh`` without a prompt, Slurm's tasks per node; :func:`keepalive_warning`). ``llmjp-ds preflight``
runs them."""

from __future__ import annotations

import ipaddress
import os
import re
import shlex
import shutil
import socket
import subprocess
import unicodedata
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from llmjp_ds.errors import fail

# deepspeed.launcher.runner._parse_hostfile's pattern, matched the same way (re.search on the stripped line)
_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")

# what a hostfile may be encoded as by mistake, by its first bytes (the launcher reads UTF-8 text)
_BOMS = ((b"\xef\xbb\xbf", "starts with a UTF-8 byte-order mark, which the deepspeed launcher would keep as part "
                           "of the first host name"),
         (b"\xff\xfe", "is UTF-16 text (it starts with a UTF-16 byte-order mark), which the deepspeed launcher "
                       "cannot read"),
         (b"\xfe\xff", "is UTF-16 text (it starts with a UTF-16 byte-order mark), which the deepspeed launcher "
                       "cannot read"))
_SAVE_AS = "save it as plain UTF-8 (ASCII) text without a BOM"


def _invisible(ch: str) -> bool:
    """A character a text editor does not show (or shows as a space) but that is not the launcher's whitespace
    around fields: a BOM, zero-width and other format characters, control characters, NUL, no-break spaces."""
    if ch in " \t":
        return False
    return unicodedata.category(ch) in ("Cc", "Cf", "Co", "Cs", "Cn", "Zs", "Zl", "Zp")


def _describe(ch: str) -> str:
    return f"U+{ord(ch):04X} ({unicodedata.name(ch, 'NUL' if ch == chr(0) else 'a control character')})"


def _hostfile_lines(path: Path) -> list[str]:
    """The lines of the hostfile as the launcher reads them (text mode: ``\\r\\n`` and ``\\r`` end lines too)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        fail(f"cannot read hostfile {path} ({exc.strerror}): check its permissions, or pass another file")
    for bom, what in _BOMS:
        if data.startswith(bom):
            fail(f"hostfile {path} {what}: {_SAVE_AS}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        lineno = data.count(b"\n", 0, exc.start) + 1
        fail(f"{path}:{lineno}: byte 0x{data[exc.start]:02x} is not UTF-8 (the launcher reads UTF-8 text): "
             f"{_SAVE_AS}")
    return text.replace("\r\n", "\n").replace("\r", "\n").split("\n")


def parse_hostfile(path: str | Path) -> dict[str, int]:
    """``{host: slots}`` in file order; one-line UserError for what the launcher would mishandle."""
    path = Path(path)
    if path.is_dir():
        fail(f"hostfile {path} is a directory: pass the file (e.g. hostfiles/h100)")
    if not path.is_file():
        fail(f"hostfile {path} does not exist: pass an existing file (the deepspeed launcher would silently start "
             "every rank on this machine instead)")
    hosts: dict[str, int] = {}
    for lineno, raw in enumerate(_hostfile_lines(path), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        bad = next((ch for ch in line if _invisible(ch)), None)
        if bad is not None:
            fail(f"{path}:{lineno}: the line holds an invisible character {_describe(bad)} at column "
                 f"{raw.index(bad) + 1}, which the deepspeed launcher would take as part of a host name or "
                 f"reject: delete it, or {_SAVE_AS}")
        m = _LINE.search(line)
        if not m:
            fail(f"{path}:{lineno}: {line[:80]!r} is not '<hostname> slots=<N>': fix or comment out that line "
                 "(see hostfiles/localhost)")
        host, slots = m.group(1), int(m.group(2))
        if not host.isascii() or not m.group(2).isascii():
            fail(f"{path}:{lineno}: {line[:80]!r} is not '<hostname> slots=<N>' in ASCII (host names and slot "
                 f"counts are ASCII; ssh/pdsh would not find this host): retype the line")
        if host in hosts:
            fail(f"{path}:{lineno}: host {host} is listed twice: list each host once, with slots = its GPU count")
        if slots < 1:
            fail(f"{path}:{lineno}: {host} has slots=0: give its GPU count, or remove the line")
        hosts[host] = slots
    if not hosts:
        fail(f"hostfile {path} lists no hosts: add one '<hostname> slots=<N>' line per node")
    return hosts


PDSH_INSTALL = "apt install pdsh (Debian, Ubuntu), dnf install pdsh pdsh-rcmd-ssh (RHEL, Rocky)"


def check_hosts(path, hosts: dict[str, int], env=None, ssh_timeout_s: float = 10.0) -> str:
    """The hosts of hostfile ``path`` as the deepspeed launcher will reach them: pdsh installed (over several
    hosts), each name resolving here, ``ssh -o BatchMode=yes host true`` succeeding, and (inside a Slurm job) the
    slots equal to its ``--ntasks-per-node``. One line naming the first problem and its fix; else what was checked."""
    env = os.environ if env is None else env
    per_node = (env.get("SLURM_NTASKS_PER_NODE") or "").strip()
    if per_node.isdigit():
        wrong = {h: n for h, n in hosts.items() if n != int(per_node)}
        if wrong:
            host, n = next(iter(wrong.items()))
            fail(f"{path}: {host} has slots={n} but the Slurm job runs {per_node} tasks per node "
                 f"(SLURM_NTASKS_PER_NODE, its --ntasks-per-node): make the two agree (preflight --write-hostfile "
                 "writes the allocation's hostfile)")
    for host in hosts:  # the hostfile's own mistake first: it stays one whatever this machine has installed
        try:
            socket.getaddrinfo(host, 22, type=socket.SOCK_STREAM)
        except OSError as exc:
            fail(f"{path}: host {host} does not resolve here ({exc.strerror or exc}): fix the name, or add it to DNS "
                 "or /etc/hosts on every host")
    if len(hosts) > 1 and shutil.which("pdsh", path=env.get("PATH")) is None:
        fail(f"pdsh is not installed: the deepspeed launcher starts the other {len(hosts) - 1} hosts of {path} with "
             f"it; install it ({PDSH_INSTALL}), or launch with srun or mpirun (hostfiles/slurm.sbatch)")
    if len(hosts) == 1 and next(iter(hosts)) in ("localhost", "127.0.0.1", socket.gethostname()):
        return "hosts OK (this host)"
    ssh = shutil.which("ssh", path=env.get("PATH"))
    if ssh is None:
        fail("ssh is not installed: pdsh reaches the hosts with it; install it (apt install openssh-client)")

    def reach(host: str) -> str | None:
        argv = [ssh, "-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(ssh_timeout_s)}", host, "true"]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=ssh_timeout_s + 5,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return "no answer"
        if done.returncode == 0:
            return None
        said = [line for line in done.stderr.splitlines() if line.strip()]
        return said[-1].strip()[:160] if said else f"ssh exited with {done.returncode}"

    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        failed = [(h, why) for h, why in zip(hosts, pool.map(reach, hosts)) if why]
    if failed:
        host, why = failed[0]
        more = f" (and {len(failed) - 1} more: {', '.join(h for h, _ in failed[1:4])})" if len(failed) > 1 else ""
        fail(f"{path}: ssh cannot reach {host}{more}: {why}; the launcher needs `ssh {host}` to work without a "
             "password or prompt (keys in ~/.ssh, the host's key accepted)")
    return f"hosts OK (pdsh, names, ssh to {len(hosts)})"


KEEPALIVE = "-o ServerAliveInterval=10 -o ServerAliveCountMax=3"


def _local_addresses() -> set[str]:
    return {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}


def runs_a_rank_here(hosts: dict[str, int]) -> bool:
    """Whether one of ``hosts`` is this host: its name, or a name resolving to an address of this host."""
    names = {socket.gethostname(), socket.gethostname().split(".")[0], socket.getfqdn(), "localhost"}
    if names & set(hosts):
        return True
    local = _local_addresses()
    for host in hosts:
        try:
            found = {info[4][0] for info in socket.getaddrinfo(host, 22, type=socket.SOCK_STREAM)}
        except OSError:
            continue
        if found & local or any(ipaddress.ip_address(a).is_loopback for a in found):
            return True
    return False


def ssh_gives_up_after_s(host: str, env=None) -> int | None:
    """How long ``ssh <host>``, as pdsh runs it (``$PDSH_SSH_ARGS_APPEND`` added), keeps a session to a silent host:
    ``ServerAliveInterval`` x ``ServerAliveCountMax`` from ``ssh -G``; 0 when it has no keepalive (it waits as long
    as TCP does); None when ssh cannot say."""
    env = os.environ if env is None else env
    ssh = shutil.which("ssh", path=env.get("PATH"))
    if ssh is None:
        return None
    argv = [ssh, "-G", *shlex.split(env.get("PDSH_SSH_ARGS_APPEND", "")), host]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    interval = re.search(r"^serveraliveinterval (\d+)$", done.stdout, re.MULTILINE)
    count = re.search(r"^serveralivecountmax (\d+)$", done.stdout, re.MULTILINE)
    if done.returncode != 0 or not interval or not count:
        return None
    return int(interval.group(1)) * max(1, int(count.group(1)))


GIVES_UP_WITHIN_S = 60  # a launch command that outlives a lost host longer than this is waiting on ssh


def keepalive_warning(path, hosts: dict[str, int], env=None) -> str | None:
    """One line when the deepspeed launcher started here could outlive a host gone silent: this host runs no rank
    of ``hosts`` (no rank here can end pdsh's session to that host) and ssh to them keeps such a session open
    for longer than a minute."""
    if len(hosts) < 2 or runs_a_rank_here(hosts):
        return None
    after = ssh_gives_up_after_s(next(iter(hosts)), env)
    if after is None or 0 < after <= GIVES_UP_WITHIN_S:
        return None
    how = ("ssh here has no keepalive (ServerAliveInterval 0)" if after == 0 else
           f"ssh here gives up on a silent host only after {after} s (ServerAliveInterval x ServerAliveCountMax)")
    return (f"warning: {path}: this host ({socket.gethostname()}) runs none of its ranks and {how}: if a host goes "
            "silent mid-run the ranks end, but the deepspeed command here waits on pdsh's ssh session to it; export "
            f"PDSH_SSH_ARGS_APPEND=\"{KEEPALIVE}\" before the launch, or launch from one of the hostfile's hosts")
