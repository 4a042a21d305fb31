"""Compare multi-GPU runs with the one-GPU run of the same global batch (benchmarks/device/run.sh multi).

    python multi_summary.py FLIP_STEP REFERENCE_RUN RUN[:GPUS] ... [--tolerance 1e-2]

For each run: the largest relative loss difference from the reference over the BF16 steps and over the FP8
steps, the median tokens/s and TFLOP/s per GPU of each phase (the first step of the run and the first FP8 step
left out: start-up and the recipe's first-call costs), and the scaling efficiency, tokens/s over GPUs x the
reference's tokens/s; then the loss of every run step by step. Exits non-zero when a run has no metrics or its
loss differs from the reference's by more than ``--tolerance`` (relative) at some step: the layouts sum in
other orders, which moved the 8-layer runs of run I (docs/multi-gpu.md) by up to 1.4e-3."""

import argparse
import statistics
from pathlib import Path

from llmjp_ds.metrics.record import current_steps, read_metrics


def records(run: str) -> dict:
    if not (Path(run) / "metrics.jsonl").is_file():
        return {}
    return {s: r for s, r in current_steps(read_metrics(run)).items() if "loss" in r}


def median(values) -> float:
    return statistics.median(values) if values else float("nan")


def phase_stats(recs: dict, steps: list) -> tuple[float, float]:
    return (median([recs[s]["tokens_per_s"] for s in steps if s in recs]),
            median([recs[s]["tflops_per_gpu"] for s in steps if s in recs]))


def max_rel(recs: dict, ref: dict, steps: list) -> float:
    common = [s for s in steps if s in recs and s in ref]
    return max((abs(recs[s]["loss"] - ref[s]["loss"]) / abs(ref[s]["loss"]) for s in common), default=float("nan"))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("flip", type=int, help="the first FP8 step")
    p.add_argument("reference")
    p.add_argument("runs", nargs="*", metavar="RUN:GPUS")
    p.add_argument("--tolerance", type=float, default=1e-2)
    a = p.parse_args()
    flip, ref_dir, runs = a.flip, a.reference, a.runs
    ref = records(ref_dir)
    if not ref:
        print(f"reference run {ref_dir} has no metrics")
        return 1
    ok = True
    last = max(ref)
    bf16_steps, fp8_steps = list(range(1, flip)), list(range(flip, last + 1))
    timed_bf16, timed_fp8 = bf16_steps[1:], fp8_steps[1:]
    ref_tok = (phase_stats(ref, timed_bf16)[0], phase_stats(ref, timed_fp8)[0])
    print(f"| run | GPUs | max rel loss diff vs {Path(ref_dir).name}, BF16 steps 1-{flip - 1} | same, FP8 steps "
          f"{flip}-{last} | BF16 tokens/s | BF16 TFLOP/s per GPU | BF16 scaling | FP8 tokens/s | "
          "FP8 TFLOP/s per GPU | FP8 scaling | FP8/BF16 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for spec in [f"{ref_dir}:1", *runs]:
        run, _, gpus = spec.rpartition(":")
        recs, n = records(run), int(gpus)
        ok &= bool(recs) and max_rel(recs, ref, bf16_steps + fp8_steps) <= a.tolerance
        if not recs:
            print(f"| {Path(run).name} | {n} | no metrics |")
            continue
        (tb, fb), (tf, ff) = phase_stats(recs, timed_bf16), phase_stats(recs, timed_fp8)
        print(f"| {Path(run).name} | {n} | {max_rel(recs, ref, bf16_steps):.2e} | {max_rel(recs, ref, fp8_steps):.2e} "
              f"| {tb:,.0f} | {fb:.0f} | {tb / (n * ref_tok[0]):.1%} | {tf:,.0f} | {ff:.0f} | "
              f"{tf / (n * ref_tok[1]):.1%} | {ff / fb:.2f}x |")
    print("loss per step:")
    names = [Path(ref_dir).name] + [Path(s.rpartition(':')[0]).name for s in runs]
    trails = [ref] + [records(s.rpartition(":")[0]) for s in runs]
    print("| step | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for s in sorted(ref):
        cells = [f"{t[s]['loss']:.5f}" if s in t else "" for t in trails]
        print(f"| {s} ({ref[s].get('precision', '')}) | " + " | ".join(cells) + " |")
    print(f"every run within {a.tolerance:.0e} of {Path(ref_dir).name} at every step: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
