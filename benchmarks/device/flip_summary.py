"""Compare the BF16 run with the FP8-flip runs: loss at the same steps, TFLOP/s before and after the flip."""

import json
import statistics
import sys
from pathlib import Path


def records(run):
    out = {}
    for line in (Path(run) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "event" not in rec:
            out[rec["step"]] = rec
    return out


base_dir, *flip_dirs = sys.argv[1:]
base = records(base_dir)
print("| run | steps 31-50 mean loss | BF16 run same steps | rel diff | max step rel diff | TFLOP/s steps 27-30 "
      "(BF16) | TFLOP/s steps 33-50 (FP8) | FP8/BF16 |")
print("|---|---|---|---|---|---|---|---|")
for d in flip_dirs:
    if not (Path(d) / "metrics.jsonl").is_file():
        print(f"| {Path(d).name} | missing |")
        continue
    r = records(d)
    steps = [s for s in range(31, 51) if s in r and s in base]
    if not steps:
        print(f"| {Path(d).name} | no steps after the flip |")
        continue
    ours = statistics.mean(r[s]["loss"] for s in steps)
    ref = statistics.mean(base[s]["loss"] for s in steps)
    worst = max(abs(r[s]["loss"] - base[s]["loss"]) / base[s]["loss"] for s in steps)
    before = [r[s]["tflops_per_gpu"] for s in range(27, 31) if s in r]
    after = [r[s]["tflops_per_gpu"] for s in range(33, 51) if s in r and r[s].get("precision") == "fp8"]
    b, a = (statistics.median(before) if before else float("nan")), (statistics.median(after) if after else float("nan"))
    print(f"| {Path(d).name} | {ours:.4f} | {ref:.4f} | {100 * (ours - ref) / ref:+.2f}% | {100 * worst:.2f}% | "
          f"{b:.0f} | {a:.0f} | {a / b:.2f}x |")
