"""``llmjp-ds preflight``: check a DeepSpeed hostfile and a run config for that cluster, starting nothing.

The ``deepspeed`` launcher owns ``--hostfile`` and we cannot intercept it: given a path that does not exist it
only logs a warning and starts every rank on the launch node ("will proceed with training with local resources
only"), and a malformed line ends in a Python traceback. Run this first, on the login node::

    llmjp-ds preflight --hostfile hostfiles/h100 --config run.yaml [--set key=value ...] [--num-nodes N]

It parses the hostfile by the launcher's own rule (``<hostname> slots=<N>`` per line, ``#`` comments, each host
once; CRLF line ends and tabs are fine, as for the launcher), refuses what the launcher would turn into a wrong
host name or a traceback (a byte-order mark, invisible or non-ASCII characters, bytes that are not UTF-8), takes
the world size as the sum of the slots (of the first ``--num-nodes`` hosts), and runs the same
:func:`llmjp_ds.validate.validate_run` the trainer runs on every rank, with that world size.

Inside a batch script, ``--write-hostfile PATH [--slots N]`` writes that hostfile from the job's allocation
(:mod:`llmjp_ds.parallel.hostfile`) and checks it; run under a launcher or scheduler, preflight first prints
where it found this process's place (``launch: slurm, world 16, nodes 2, master node01:12345``).

``--check-hosts`` then checks the hosts as the launcher will reach them (:func:`check_hosts`): over several
hosts pdsh must be installed (the launcher starts the other hosts with it), every host name must resolve here,
and ``ssh <host> true`` must succeed without a prompt; under Slurm the slots must match ``--ntasks-per-node``.
When this host runs no rank of the hostfile (a login node) and its ssh has no keepalive, one warning line says
what to set (:func:`keepalive_warning`): a host that goes silent mid-run leaves pdsh's ssh session to it open,
and only a rank on the launching host can end that session (:mod:`llmjp_ds.parallel.launcher`).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

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
    import unicodedata

    if ch in " \t":
        return False
    return unicodedata.category(ch) in ("Cc", "Cf", "Co", "Cs", "Cn", "Zs", "Zl", "Zp")


def _describe(ch: str) -> str:
    import unicodedata

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


def launch_hostfile(a) -> str:
    """The hostfile to check: ``--hostfile``, or the one ``--write-hostfile`` writes from the allocation; prints the
    launch this process sits in, when a launcher or scheduler started it."""
    from llmjp_ds.parallel import scheduler

    job = scheduler.detect()
    if job.source != "single process":
        print(job.describe())
    if a.write_hostfile and a.hostfile:
        fail("--hostfile and --write-hostfile: pass one (--write-hostfile writes the hostfile that is then checked)")
    if a.slots is not None and not a.write_hostfile:
        fail("--slots applies to --write-hostfile only: a hostfile given with --hostfile has its own slots")
    if a.write_hostfile:
        from llmjp_ds.parallel.hostfile import write_hostfile

        print(write_hostfile(a.write_hostfile, slots=a.slots))
        a.hostfile = a.write_hostfile
    if not a.hostfile:
        fail("pass --hostfile FILE (a DeepSpeed hostfile), or --write-hostfile PATH to write one from the job's "
             "allocation ($PE_HOSTFILE, $PBS_NODEFILE or $SLURM_JOB_NODELIST)")
    return a.hostfile


def cli_main(argv: list[str], verb: str = "preflight") -> int:
    p = argparse.ArgumentParser(prog=f"llmjp-ds {verb}", description=__doc__.splitlines()[0])
    p.add_argument("--hostfile", help="DeepSpeed hostfile, e.g. hostfiles/h100")
    p.add_argument("--write-hostfile", metavar="PATH", help="write the DeepSpeed hostfile of this job's allocation "
                   "($PE_HOSTFILE, $PBS_NODEFILE or the Slurm nodelist) to PATH, then check it")
    p.add_argument("--slots", type=int, default=None, help="with --write-hostfile: slots (GPUs) of every host")
    p.add_argument("--check-hosts", action="store_true",
                   help="check that pdsh is installed and every host resolves and answers ssh (as the launcher needs)")
    p.add_argument("--num-nodes", type=int, default=None, help="use the first N hosts (as the launcher's flag)")
    p.add_argument("--config", help="run config (YAML or JSON)")
    p.add_argument("--preset", help="run preset")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--gpu-gib", type=float, default=79.6, help="memory of one GPU in GiB (H100 80GB: 79.6)")
    p.add_argument("--disk-gbps", type=float, default=None,
                   help="write speed of a node to the run directory in GB/s: how long a background save writes, "
                        "and the smallest checkpoint.interval that does not wait for it")
    p.add_argument("--step-seconds", type=float, default=None,
                   help="the expected time of one step (with --disk-gbps: the interval in steps)")
    a = p.parse_args(argv)
    for flag, value in (("--disk-gbps", a.disk_gbps), ("--step-seconds", a.step_seconds)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            fail(f"{flag} {value}: give a positive number")
    hosts = parse_hostfile(launch_hostfile(a))
    if a.num_nodes is not None:
        if not 1 <= a.num_nodes <= len(hosts):
            fail(f"--num-nodes {a.num_nodes}: {a.hostfile} lists {len(hosts)} hosts; pass 1 to {len(hosts)}")
        hosts = dict(list(hosts.items())[: a.num_nodes])
    world = sum(hosts.values())
    line = f"{a.hostfile}: {len(hosts)} hosts, {world} ranks"
    if a.check_hosts:
        line += "; " + check_hosts(a.hostfile, hosts)
        warning = keepalive_warning(a.hostfile, hosts)
        if warning:
            print(warning, file=sys.stderr)
    if a.config or a.preset or a.sets:
        from llmjp_ds.config import load_config
        from llmjp_ds.validate import validate_run

        cfg = load_config(a.config, a.sets, a.preset)
        # the launcher fills each host's slots with consecutive ranks: a TP group stays on one node when it
        # divides every host's slot count
        layout = validate_run(cfg, world, gpus_per_node=math.gcd(*hosts.values()))
        gas = layout.gradient_accumulation_steps(cfg.train.global_batch_size, cfg.train.micro_batch_size)
        line += f"; config OK: {layout.describe(cfg.parallel.zero_stage)}, gradient accumulation {gas}"
        print(line)
        line = memory_line(cfg, layout, gas, a.gpu_gib, ranks_per_node=max(hosts.values()), disk_gbps=a.disk_gbps,
                           step_s=a.step_seconds)
    print(line)
    return 0


PDSH_INSTALL = "apt install pdsh (Debian, Ubuntu), dnf install pdsh pdsh-rcmd-ssh (RHEL, Rocky)"


def check_hosts(path, hosts: dict[str, int], env=None, ssh_timeout_s: float = 10.0) -> str:
    """The hosts of hostfile ``path`` as the deepspeed launcher will reach them: pdsh installed (over several
    hosts), each name resolving here, ``ssh -o BatchMode=yes host true`` succeeding, and (inside a Slurm job) the
    slots equal to its ``--ntasks-per-node``. One line naming the first problem and its fix; else what was checked."""
    import os
    import shutil
    import socket
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

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
        fail(f"pdsh is not installed: the deepspeed launcher starts the other {len(hosts) - 1} hosts of {path} with it; "
             f"install it ({PDSH_INSTALL}), or launch with srun or mpirun (hostfiles/slurm.sbatch)")
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
    import psutil

    return {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}


def runs_a_rank_here(hosts: dict[str, int]) -> bool:
    """Whether one of ``hosts`` is this host: its name, or a name resolving to an address of this host."""
    import ipaddress
    import socket

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
    import os
    import shlex
    import shutil
    import subprocess

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
    import socket

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


def memory_line(cfg, layout, gas: int, capacity_gib: float, ranks_per_node: int | None = None,
                disk_gbps: float | None = None, step_s: float | None = None) -> str:
    """The busiest GPU's memory estimate (``parallel.memory``) for a ZeRO-1 run; a note otherwise."""
    if cfg.parallel.zero_stage != 1:
        return f"no memory estimate for ZeRO-{cfg.parallel.zero_stage} (parallel/memory.py models ZeRO-1)"
    from llmjp_ds.config import model_config_of, seq_len_of, sequence_parallel_of
    from llmjp_ds.model.shapes import resolve_shape
    from llmjp_ds.parallel.memory import describe, layout_memory, stage_layers

    model_config = model_config_of(cfg)
    if layout.pipeline > 1:
        from llmjp_ds.model.pipeline import flops_weights
        from llmjp_ds.parallel.pipeline import stage_bounds

        bounds = stage_bounds(flops_weights(model_config, seq_len_of(cfg, model_config)), layout.pipeline)
        layers = stage_layers(bounds, model_config.num_hidden_layers)
    else:
        layers = [model_config.num_hidden_layers]
    stages = layout_memory(resolve_shape(cfg.model.shape, cfg.model.overrides), layers, layout.data,
                           cfg.train.micro_batch_size, seq_len_of(cfg, model_config), gas,
                           recompute=cfg.model.recompute, tensor=layout.tensor,
                           sequence_parallel=sequence_parallel_of(cfg))
    busiest = max(stages, key=lambda s: s.total)
    line = describe(busiest, capacity_gib)
    if cfg.checkpoint.async_save:
        from llmjp_ds.parallel.memory import node_snapshot_gib, snapshot_gib

        dtype_bytes = 2 if cfg.precision.dtype == "bf16" else 4
        per_node = ranks_per_node or layout.world
        node = node_snapshot_gib(busiest, layout.data, dtype_bytes, per_node)
        line += (f"\nasync checkpoints (checkpoint.async_save): ~{node:.1f} GiB of pinned host memory on the busiest "
                 f"node ({per_node} ranks; busiest rank ~{snapshot_gib(busiest, layout.data, dtype_bytes):.1f} GiB)")
        if disk_gbps:
            line += "\n" + interval_line(cfg.checkpoint.interval, node, disk_gbps, step_s)
    return line


def interval_line(interval: int, node_gib: float, disk_gbps: float, step_s: float | None) -> str:
    """How long the busiest node writes a background save at ``disk_gbps``; with a step time, whether
    ``checkpoint.interval`` leaves it the time (the advice the trainer gives when a save waits)."""
    from llmjp_ds.checkpoint.async_save import interval_advice, smallest_interval

    write_s = node_gib * 2**30 / 1e9 / disk_gbps
    if step_s is None:
        return (f"a save writes ~{write_s:.0f} s at {disk_gbps:g} GB/s: keep checkpoint.interval above {write_s:.0f} s "
                "of steps (pass --step-seconds for the count)")
    needed = smallest_interval(write_s, step_s)
    if interval and interval < needed:
        return "warning: " + interval_advice(node_gib, write_s, interval, step_s)
    return (f"a save writes ~{write_s:.0f} s at {disk_gbps:g} GB/s; checkpoint.interval={interval} leaves it "
            f"{interval * step_s:.0f} s (it needs at least {needed} steps)")
