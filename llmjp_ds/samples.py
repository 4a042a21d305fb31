"""``llmjp-ds samples``: the token windows a run's trainer would read, written to a ``.npy``, without training.

The run's datasets are built as the trainer builds them (the config, :func:`llmjp_ds.trainer.run_data`: each
data phase's blend with the run's sample counts), and global samples ``K .. K+N-1`` of the train or valid split
are written as an int64 array of shape ``(N, seq_len + 1)`` (inputs ``[:, :-1]``, labels ``[:, 1:]``), atomically.
No DeepSpeed engine, no process group beyond the one-process group megatron-core's builder asks for, no run
directory lock, nothing written into the run directory; the index caches are built or reused as a run would. Under
``data.order: megatron`` these are megatron-core's windows: a Megatron-LM run with the same blend, seq_len, seed,
split and length can be compared with it window by window. Step ``s`` of a run (numbered from 1) reads train
samples ``[(s - 1) * gbs, s * gbs)`` (with a ramped or changed batch, from ``BatchSchedule.consumed_at(s - 1)``);
which valid samples a validation reads: :func:`llmjp_ds.data.batching.validation_starts` (of ``data.blend``'s valid
split).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from llmjp_ds.checkpoint.store import latest_tag, read_marker
from llmjp_ds.config import (add_config_args, apply_set, build_config, config_from_args, model_config_of,
                             sample_counts, seq_len_of)
from llmjp_ds.errors import did_you_mean, fail
from llmjp_ds.data.batching import skipped
from llmjp_ds.io_utils import atomic_file, one_line_write_errors
from llmjp_ds.validate import validate_data

SPLITS = ("train", "valid")


def parse_args(argv: list[str], verb: str):
    p = argparse.ArgumentParser(prog=f"llmjp-ds {verb}", description=__doc__.splitlines()[0])
    add_config_args(p, example="data.order=megatron")
    p.add_argument("--run", metavar="RUN_DIR", help="a run's own samples: its config as its latest checkpoint records "
                   "it (in place of --config/--preset), and the samples of the steps it skipped (train.skip_steps and "
                   "its rollbacks') left out")
    p.add_argument("--split", default="train", help="train (default) or valid")
    p.add_argument("--start", type=int, metavar="K", help="the first global sample of the split")
    p.add_argument("--count", type=int, metavar="N", help="how many samples")
    p.add_argument("--output", metavar="F.npy", help="where to write the (N, seq_len + 1) int64 array")
    p.add_argument("--force", action="store_true", help="replace an existing output file")
    args = p.parse_args(argv)
    if args.split not in SPLITS:
        fail(f"--split {args.split!r} is not a split a run reads{did_you_mean(args.split, SPLITS)}: use train or "
             "valid")
    for name in ("start", "count", "output"):
        if getattr(args, name) is None:
            fail(f"--{name} is missing: llmjp-ds {verb} --config RUN.yaml --start K --count N --output F.npy")
    if args.start < 0 or args.count < 1:
        fail(f"--start {args.start} --count {args.count}: give a first sample >= 0 and a count >= 1")
    if os.path.lexists(args.output) and not args.force:
        fail(f"output {args.output} already exists: choose another --output, or pass --force to replace it")
    if os.path.isdir(args.output):
        fail(f"output {args.output} is a directory: give a file name such as windows.npy")
    if args.run and (args.config or args.preset):
        fail("--run reads the run's config from its latest checkpoint: leave out --config and --preset (--set still "
             "applies)")
    return args


def run_config_and_skips(run_dir: str, sets) -> tuple:
    """The config (and ``sets`` over it) and the skipped steps of ``run_dir``'s latest checkpoint."""
    tag = latest_tag(run_dir)
    if tag is None:
        fail(f"{run_dir} has no checkpoint: --run reads a run's config and skipped steps from its latest checkpoint")
    marker = read_marker(run_dir, tag)
    if not marker.run_config:
        fail(f"checkpoint {tag} of {run_dir} records no run config (an earlier release wrote it): pass --config")
    data = marker.run_config
    for assignment in sets:
        data = apply_set(data, assignment)
    return build_config(data), marker.skip_steps or []


def cli_main(argv: list[str], verb: str = "samples") -> int:
    args = parse_args(argv, verb)
    skips: list = []
    if args.run:
        cfg, skips = run_config_and_skips(args.run, args.sets)
    else:
        cfg = config_from_args(args)
    validate_data(cfg)
    counts = dict(zip(SPLITS, sample_counts(cfg)))
    total, end = counts[args.split], args.start + args.count
    if not total:
        fail(f"the run reads no {args.split} samples (train.eval_interval is 0: no validation): set "
             "train.eval_interval to the run's, or ask for --split train")
    if end > total:
        fail(f"--start {args.start} --count {args.count} reads up to {args.split} sample {end - 1}, but the run reads "
             f"{total} {args.split} samples: ask for samples below {total}, or lengthen the run (train.steps)")
    from llmjp_ds.trainer import run_data  # startup time: the trainer's room loads torch and DeepSpeed

    model_config = model_config_of(cfg)
    seq_len = seq_len_of(cfg, model_config)
    t0 = time.perf_counter()
    data = run_data(cfg, model_config, seq_len)
    # a train sample from the data phase of the step that reads it; valid samples of data.blend's valid split
    wanted, gone = range(args.start, end), []
    if args.split == "train" and skips:  # the samples of skipped steps were read, not trained on (steps from 1)
        gone = sorted({st for st in {data.batches.step_of_sample(i) + 1 for i in wanted} if skipped(st, skips)})
        wanted = [i for i in wanted if data.batches.step_of_sample(i) + 1 not in gone]
    sample = data.train_sample if args.split == "train" else data.valid_at(0).__getitem__
    windows = np.stack([np.asarray(sample(i), dtype=np.int64) for i in wanted]) if wanted else \
        np.zeros((0, seq_len + 1), dtype=np.int64)
    with one_line_write_errors(args.output, "free space or choose another --output, then run it again"), \
            atomic_file(args.output) as f:
        np.save(f, windows)
    left_out = args.count - len(wanted)
    print(f"wrote {args.output}: {args.split} samples {args.start}..{end - 1} ({windows.shape[0]} x {windows.shape[1]} "
          f"tokens, order {cfg.data.order}, datasets ready in {time.perf_counter() - t0:.1f} s)"
          + (f"; {left_out} of skipped steps {_ranges(gone)} left out" if left_out else ""))
    return 0


def _ranges(steps: list[int]) -> str:
    """Steps as the records number them, runs of them as ``a..b``: ``5..6, 9``."""
    runs: list[list[int]] = []
    for step in steps:
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return ", ".join(f"{a}..{b}" if a != b else str(a) for a, b in runs)
