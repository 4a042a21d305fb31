"""Summarise a run's checkpoint stalls from its metrics.jsonl (benchmarks/device/run.sh async).

    python benchmarks/device/async_summary.py RUN_DIR [RUN_DIR ...]

Per save: the stall the loop saw (``save_stall_s``: waiting for a write still in flight plus the snapshot), the
background write's time, and the gap between the wall-clock times of the step records around the save; then
the mean step time and tokens/s of the steps run while a write was in flight against the others.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from llmjp_ds.metrics.record import current_steps


def summarise(run_dir: Path) -> None:
    records = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    steps = {s: r for s, r in current_steps(records).items() if "loss" in r}
    committed = {r["tag"]: r for r in records if r.get("event") == "checkpoint_committed"}
    print(f"== {run_dir}")
    in_flight: set[int] = set()
    for step, r in sorted(steps.items()):
        if "save_stall_s" not in r:
            continue
        saved = step - 1
        gap = r["time"] - steps[saved]["time"] if saved in steps else float("nan")
        tag = f"step{saved:08d}"
        write = committed.get(tag, {}).get("write_s")
        end = committed.get(tag, {}).get("step", max(steps))
        if write is not None:
            in_flight |= set(range(step, end + 1))
        print(f"save at step {saved}: stall {r['save_stall_s']:.2f} s (waiting for the previous write "
              f"{r.get('save_wait_s', 0):.2f} s), step-record gap {gap:.2f} s (step itself "
              f"{r['step_time_s']:.2f} s), background write "
              + (f"{write:.1f} s, committed by step {end}" if write is not None else "(synchronous)"))
    others = [r for s, r in steps.items() if s not in in_flight and s > 2 and "save_stall_s" not in r]
    during = [r for s, r in steps.items() if s in in_flight and "save_stall_s" not in r]
    for name, group in (("no write in flight", others), ("during a background write", during)):
        if group:
            print(f"{name}: {len(group)} steps, mean step {sum(r['step_time_s'] for r in group) / len(group):.3f} s,"
                  f" {sum(r['tflops_per_gpu'] for r in group) / len(group):.0f} TFLOP/s")


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        summarise(Path(arg))
