"""Compare multi-GPU runs with the one-GPU run of the same global batch (benchmarks/device/h200_multi.sh).

    python multi_summary.py FLIP_STEP REFERENCE_RUN RUN[:GPUS] ... [--resumed FULL_RUN:RESUMED_RUN:STEP ...]

For each run: the largest relative loss difference from the reference over the BF16 steps and over the FP8
steps, the median tokens/s and TFLOP/s per GPU of each phase (the first step of the run and the first FP8 step
left out: start-up and the recipe's first-call costs), and the scaling efficiency, tokens/s over GPUs x the
reference's tokens/s. ``--resumed FULL:RESUMED:STEP`` compares the steps a run resumed at STEP trained with the uninterrupted run's."""

import json
import statistics
import sys
from pathlib import Path


def records(run: str) -> dict:
    path = Path(run) / "metrics.jsonl"
    if not path.is_file():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "event" not in rec and "loss" in rec:
            out[rec["step"]] = rec
    return out


def median(values) -> float:
    return statistics.median(values) if values else float("nan")


def phase_stats(recs: dict, steps: list) -> tuple[float, float]:
    return (median([recs[s]["tokens_per_s"] for s in steps if s in recs]),
            median([recs[s]["tflops_per_gpu"] for s in steps if s in recs]))


def max_rel(recs: dict, ref: dict, steps: list) -> float:
    common = [s for s in steps if s in recs and s in ref]
    return max((abs(recs[s]["loss"] - ref[s]["loss"]) / abs(ref[s]["loss"]) for s in common), default=float("nan"))


def main(argv: list) -> None:
    resumed = []
    if "--resumed" in argv:
        cut = argv.index("--resumed")
        argv, resumed = argv[:cut], argv[cut + 1:]
    flip, ref_dir, runs = int(argv[0]), argv[1], argv[2:]
    ref = records(ref_dir)
    if not ref:
        print(f"reference run {ref_dir} has no metrics")
        return
    last = max(ref)
    bf16_steps, fp8_steps = list(range(1, flip + 1)), list(range(flip + 1, last + 1))
    timed_bf16, timed_fp8 = bf16_steps[1:], fp8_steps[1:]
    ref_tok = (phase_stats(ref, timed_bf16)[0], phase_stats(ref, timed_fp8)[0])
    print(f"| run | GPUs | max rel loss diff vs {Path(ref_dir).name}, BF16 steps 1-{flip} | same, FP8 steps "
          f"{flip + 1}-{last} | BF16 tokens/s | BF16 TFLOP/s per GPU | BF16 scaling | FP8 tokens/s | "
          "FP8 TFLOP/s per GPU | FP8 scaling | FP8/BF16 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for spec in [f"{ref_dir}:1", *runs]:
        run, _, gpus = spec.rpartition(":")
        recs, n = records(run), int(gpus)
        if not recs:
            print(f"| {Path(run).name} | {n} | no metrics |")
            continue
        (tb, fb), (tf, ff) = phase_stats(recs, timed_bf16), phase_stats(recs, timed_fp8)
        print(f"| {Path(run).name} | {n} | {max_rel(recs, ref, bf16_steps):.2e} | {max_rel(recs, ref, fp8_steps):.2e} "
              f"| {tb:,.0f} | {fb:.0f} | {tb / (n * ref_tok[0]):.1%} | {tf:,.0f} | {ff:.0f} | "
              f"{tf / (n * ref_tok[1]):.1%} | {ff / fb:.2f}x |")
    for spec in resumed:
        full_dir, resumed_dir, start = spec.split(":")
        full, again = records(full_dir), records(resumed_dir)
        steps = [s for s in sorted(again) if s > int(start)]
        print(f"{Path(resumed_dir).name} (resumed at step {start}) vs {Path(full_dir).name}: steps {steps}, "
              f"max rel loss diff {max_rel(again, full, steps):.2e}")
    print("loss per step:")
    names = [Path(ref_dir).name] + [Path(s.rpartition(':')[0]).name for s in runs]
    trails = [ref] + [records(s.rpartition(":")[0]) for s in runs]
    print("| step | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for s in sorted(ref):
        cells = [f"{t[s]['loss']:.5f}" if s in t else "" for t in trails]
        print(f"| {s} ({ref[s].get('precision', '')}) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
