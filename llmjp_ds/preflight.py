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
(:mod:`llmjp_ds.launch.hostfile`) and checks it; run under a launcher or scheduler, preflight first prints
where it found this process's place (``launch: slurm, world 16, nodes 2, master node01:12345``).

``--check-hosts`` then checks the hosts as the launcher will reach them
(:func:`llmjp_ds.launch.hosts.check_hosts`): over several hosts pdsh must be installed (the launcher starts the
other hosts with it), every host name must resolve here, and ``ssh <host> true`` must succeed without a prompt;
under Slurm the slots must match ``--ntasks-per-node``. When this host runs no rank of the hostfile (a login node)
and its ssh has no keepalive, one warning line says what to set (:func:`llmjp_ds.launch.hosts.keepalive_warning`):
a host that goes silent mid-run leaves pdsh's ssh session to it open, and only a rank on the launching host can
end that session (:mod:`llmjp_ds.launch.launcher`).
"""

from __future__ import annotations

import argparse
import math
import sys

from llmjp_ds.config import add_config_args, config_from_args, model_config_of, seq_len_of, sequence_parallel_of
from llmjp_ds.errors import fail
from llmjp_ds.launch import scheduler
from llmjp_ds.launch.hostfile import write_hostfile
from llmjp_ds.launch.hosts import check_hosts, keepalive_warning, parse_hostfile
from llmjp_ds.optim.lr_schedule import plan_line
from llmjp_ds.model.shapes import resolve_shape
from llmjp_ds.parallel.memory import describe, layout_memory, node_snapshot_gib, snapshot_gib, stage_layers
from llmjp_ds.validate import validate_run


def launch_hostfile(a) -> str:
    """The hostfile to check: ``--hostfile``, or the one ``--write-hostfile`` writes from the allocation; prints the
    launch this process sits in, when a launcher or scheduler started it."""
    job = scheduler.detect()
    if job.source != "single process":
        print(job.describe())
    if a.write_hostfile and a.hostfile:
        fail("--hostfile and --write-hostfile: pass one (--write-hostfile writes the hostfile that is then checked)")
    if a.slots is not None and not a.write_hostfile:
        fail("--slots applies to --write-hostfile only: a hostfile given with --hostfile has its own slots")
    if a.write_hostfile:
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
    add_config_args(p)
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
        cfg = config_from_args(a)
        # the launcher fills each host's slots with consecutive ranks: a TP group stays on one node when it
        # divides every host's slot count
        layout = validate_run(cfg, world, gpus_per_node=math.gcd(*hosts.values()))
        gas = layout.gradient_accumulation_steps(cfg.train.global_batch_size, cfg.train.micro_batch_size)
        line += f"; config OK: {layout.describe(cfg.parallel.zero_stage)}, gradient accumulation {gas}"
        print(line)
        print(plan_line(cfg))
        line = memory_line(cfg, layout, gas, a.gpu_gib, ranks_per_node=max(hosts.values()), disk_gbps=a.disk_gbps,
                           step_s=a.step_seconds)
    print(line)
    return 0



def memory_line(cfg, layout, gas: int, capacity_gib: float, ranks_per_node: int | None = None,
                disk_gbps: float | None = None, step_s: float | None = None) -> str:
    """The busiest GPU's memory estimate (``parallel.memory``) for a ZeRO-1 run; a note otherwise."""
    if cfg.parallel.zero_stage != 1:
        return f"no memory estimate for ZeRO-{cfg.parallel.zero_stage} (parallel/memory.py models ZeRO-1)"

    model_config = model_config_of(cfg)
    if layout.pipeline > 1:
        from llmjp_ds.model.pipeline_layers import flops_weights
        from llmjp_ds.parallel.stages import stage_bounds

        bounds = stage_bounds(flops_weights(model_config, seq_len_of(cfg, model_config)), layout.pipeline)
        layers = stage_layers(bounds, model_config.num_hidden_layers)
    else:
        layers = [model_config.num_hidden_layers]
    stages = layout_memory(resolve_shape(cfg.model.shape, cfg.model.overrides), layers, layout.data,
                           cfg.train.micro_batch_size, seq_len_of(cfg, model_config), gas,
                           recompute=cfg.model.recompute, tensor=layout.tensor,
                           sequence_parallel=sequence_parallel_of(cfg), expert=layout.expert)
    busiest = max(stages, key=lambda s: s.total)
    line = describe(busiest, capacity_gib)
    if cfg.checkpoint.async_save:
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
