"""The FP8 fidelity table of docs/precision.md from the runs of benchmarks/device/fp8_fidelity.sh.

    python fidelity_summary.py RUNS_DIR FLIP_STEP

Per window of steps after the flip: each FP8 run's mean training-loss gap to the BF16 seed-42 run (same seed,
same data), the BF16 seed-43 run's gap (the noise), and the online ``fp8_penalty`` of the validations in that
window; and the ``recipe_choice`` event of the ``auto`` run."""

import json
import statistics
import sys
from pathlib import Path


def load(run: Path) -> tuple[dict, list]:
    steps, events = {}, []
    path = run / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        rec = json.loads(line)
        (events.append(rec) if "event" in rec else steps.setdefault(rec["step"], {}).update(rec))
    return steps, events


def gap(run: dict, ref: dict, lo: int, hi: int) -> str:
    common = [s for s in range(lo, hi + 1) if s in run and s in ref and "loss" in run[s]]
    if not common:
        return ""
    return f"{100 * statistics.mean(run[s]['loss'] / ref[s]['loss'] - 1 for s in common):+.3f} %"


def penalty(run: dict, lo: int, hi: int) -> str:
    values = [run[s]["fp8_penalty"] for s in range(lo, hi + 1) if s in run and "fp8_penalty" in run[s]]
    return f"{100 * statistics.mean(values):+.3f} %" if values else ""


def main(root: str, flip: int) -> None:
    root = Path(root)
    runs = {name: load(root / name) for name in ("bf16_s42", "bf16_s43", "delayed", "current", "block", "auto")}
    ref = runs["bf16_s42"][0]
    if not ref:
        print("no bf16_s42 run")
        return
    last = max(ref)
    edges = [1, flip + 1] + list(range(flip + 100, last, 200)) + [last + 1]
    windows = [(a, b - 1) for a, b in zip(edges, edges[1:]) if b - 1 >= a]
    print("| steps | BF16 seed 43 vs seed 42 (noise) | delayed: loss gap | delayed: fp8_penalty | current: loss gap "
          "| current: fp8_penalty | block: loss gap | block: fp8_penalty | BF16 seed-42 loss |")
    print("|" + "---|" * 9)
    for lo, hi in windows:
        cells = [gap(runs["bf16_s43"][0], ref, lo, hi)]
        for recipe in ("delayed", "current", "block"):
            cells += [gap(runs[recipe][0], ref, lo, hi), penalty(runs[recipe][0], lo, hi)]
        losses = [ref[s]["loss"] for s in range(lo, hi + 1) if s in ref]
        cells.append(f"{statistics.mean(losses):.3f}" if losses else "")
        print(f"| {lo}-{hi} | " + " | ".join(cells) + " |")
    for event in runs["auto"][1]:
        if event["event"] == "recipe_choice":
            print(f"recipe auto at step {event['step']}: {event['chosen']} ({event['reason']})")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
