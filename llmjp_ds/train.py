"""Pretrain (or resume) a run: ``deepspeed llmjp_ds/train.py [--config FILE] [--set key=value ...]``.

Also ``python -m llmjp_ds.train`` and ``llmjp-ds train``, under torchrun, or a task per rank under ``srun`` or
``mpirun`` (:mod:`llmjp_ds.launch.scheduler` reads each task's place). With no arguments it runs the embedded
default: the ``demo`` preset (``tiny`` model on the bundled corpus, on CPU if there is no GPU). This file is the
launcher's entry point: it parses the command line, loads the config and hands it to
:class:`llmjp_ds.trainer.Trainer`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script by the deepspeed launcher
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmjp_ds.config import RunConfig, add_config_args, config_from_args  # noqa: E402
from llmjp_ds.errors import fail, run_main  # noqa: E402
from llmjp_ds.launch.failure import end_on_error
from llmjp_ds.launch.scheduler import prepare_launch
from llmjp_ds.validate import validate_run


def parse_args(argv):
    p = argparse.ArgumentParser(prog="llmjp-ds train", description=__doc__.splitlines()[0])
    add_config_args(p)
    p.add_argument("--wait-for-run-dir", type=float, default=0.0, metavar="SECONDS",
                   help="when another job still holds run_dir (a requeued job whose predecessor is finishing its "
                        "last save), wait up to SECONDS for it to end instead of ending at once")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not (math.isfinite(args.wait_for_run_dir) and args.wait_for_run_dir >= 0):
        fail(f"--wait-for-run-dir {args.wait_for_run_dir}: give the seconds to wait for the run directory, 0 or "
             "more (0: refuse at once)")
    return args


def train(cfg: RunConfig, wait_for_run_dir: float = 0.0) -> dict:
    """Run the configured training; returns a summary (final step, last loss, run directory)."""
    layout = validate_run(cfg)  # a mistake in the config costs a second, before torch and DeepSpeed load
    from llmjp_ds.trainer import Trainer  # startup time: torch, transformers and DeepSpeed load here

    return Trainer(cfg, layout, wait_for_run_dir).fit()


def shutdown(clean: bool = True) -> None:
    """Close the process group; ``clean``: after a finished run, when every rank reaches this barrier."""
    if "torch.distributed" not in sys.modules:  # failed before torch loaded (a config error): nothing to close
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()


def cli_main(argv: list[str] | None, verb: str = "train") -> int:
    args = parse_args(argv or [])

    # srun / mpirun give their ranks no torchrun variables: export this task's place before the world size is read
    job = prepare_launch()
    if job.source in ("slurm", "openmpi", "pmi") and job.world_size > 1 and job.rank == 0:
        print(f"[llmjp-ds] {job.describe()}", flush=True)
    cfg = config_from_args(args)
    try:
        summary = train(cfg, args.wait_for_run_dir)
    except BaseException as exc:
        end_on_error(exc)  # a multi-rank job: every rank ends now, the failing one says why (no return)
        shutdown(clean=False)
        raise
    shutdown()
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[llmjp-ds] done: step {summary['step']}, loss {summary['loss']:.4f}, run {summary['run_dir']}")
    return 0


def main() -> None:
    run_main(lambda argv: cli_main(argv))


if __name__ == "__main__":
    main()
