"""``llmjp-ds preflight``: check a DeepSpeed hostfile and a run config for that cluster, starting nothing.

The ``deepspeed`` launcher owns ``--hostfile`` and we cannot intercept it: given a path that does not exist it
only logs a warning and starts every rank on the launch node ("will proceed with training with local resources
only"), and a malformed line ends in a Python traceback. Run this first, on the login node::

    llmjp-ds preflight --hostfile hostfiles/h100 --config run.yaml [--set key=value ...] [--num-nodes N]

It parses the hostfile by the launcher's own rule (``<hostname> slots=<N>`` per line, ``#`` comments, each host
once), takes the world size as the sum of the slots (of the first ``--num-nodes`` hosts), and runs the same
:func:`llmjp_ds.validate.validate_run` the trainer runs on every rank, with that world size.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from llmjp_ds.errors import fail

# deepspeed.launcher.runner._parse_hostfile's pattern, matched the same way (re.search on the stripped line)
_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")


def parse_hostfile(path: str | Path) -> dict[str, int]:
    """``{host: slots}`` in file order; one-line UserError for what the launcher would mishandle."""
    path = Path(path)
    if not path.is_file():
        fail(f"hostfile {path} does not exist: pass an existing file (the deepspeed launcher would silently start "
             "every rank on this machine instead)")
    hosts: dict[str, int] = {}
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        fail(f"cannot read hostfile {path} ({exc}): pass a text file of '<hostname> slots=<N>' lines")
    for lineno, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.search(line)
        if not m:
            fail(f"{path}:{lineno}: {line[:80]!r} is not '<hostname> slots=<N>': fix or comment out that line "
                 "(see hostfiles/localhost)")
        host, slots = m.group(1), int(m.group(2))
        if host in hosts:
            fail(f"{path}:{lineno}: host {host} is listed twice: list each host once, with slots = its GPU count")
        if slots < 1:
            fail(f"{path}:{lineno}: {host} has slots=0: give its GPU count, or remove the line")
        hosts[host] = slots
    if not hosts:
        fail(f"hostfile {path} lists no hosts: add one '<hostname> slots=<N>' line per node")
    return hosts


def cli_main(argv: list[str], verb: str = "preflight") -> int:
    p = argparse.ArgumentParser(prog=f"llmjp-ds {verb}", description=__doc__.splitlines()[0])
    p.add_argument("--hostfile", required=True, help="DeepSpeed hostfile, e.g. hostfiles/h100")
    p.add_argument("--num-nodes", type=int, default=None, help="use the first N hosts (as the launcher's flag)")
    p.add_argument("--config", help="run config (YAML or JSON)")
    p.add_argument("--preset", help="run preset")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args(argv)
    hosts = parse_hostfile(a.hostfile)
    if a.num_nodes is not None:
        if not 1 <= a.num_nodes <= len(hosts):
            fail(f"--num-nodes {a.num_nodes}: {a.hostfile} lists {len(hosts)} hosts; pass 1 to {len(hosts)}")
        hosts = dict(list(hosts.items())[: a.num_nodes])
    world = sum(hosts.values())
    line = f"{a.hostfile}: {len(hosts)} hosts, {world} ranks"
    if a.config or a.preset or a.sets:
        from llmjp_ds.config import load_config
        from llmjp_ds.validate import validate_run

        cfg = load_config(a.config, a.sets, a.preset)
        layout = validate_run(cfg, world)
        gas = layout.gradient_accumulation_steps(cfg.train.global_batch_size, cfg.train.micro_batch_size)
        line += f"; config OK: {layout.describe(cfg.parallel.zero_stage)}, gradient accumulation {gas}"
    print(line)
    return 0
