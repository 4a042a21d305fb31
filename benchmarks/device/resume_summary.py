"""Compare an uninterrupted run with one that stopped at a checkpoint and resumed (the device checks flow, async,
cluster and multi): loss, grad norm and precision phase step by step, the events of each (the flip, the stop, the
resume), and the largest relative loss difference before and after the resume.

    python benchmarks/device/resume_summary.py RUN_UNINTERRUPTED RUN_RESUMED [--flip STEP] [--tolerance 2e-3]

Exits non-zero when a step is missing, a phase differs, the resumed run did not resume, a loss after the resume
differs by more than ``--tolerance`` (relative), or, with ``--flip``, either run did not flip at STEP. Two GPU
runs of one configuration differ by up to ~6e-4 before any resume (cuDNN's attention backward is not
deterministic; docs/performance.md, run F), so the tolerance is a few times that; on CPUs the trails are equal.
"""

import argparse
import sys

from llmjp_ds.metrics.record import current_steps, read_metrics


def split(run):
    records = read_metrics(run)
    return ({s: r for s, r in current_steps(records).items() if "loss" in r},
            [(r["step"], r["event"]) for r in records if "event" in r], records)


def main(argv) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("uninterrupted")
    p.add_argument("resumed")
    p.add_argument("--flip", type=int, help="the step both runs must flip precision at")
    p.add_argument("--tolerance", type=float, default=2e-3)
    a = p.parse_args(argv)
    (whole, whole_events, _), (resumed, resumed_events, records) = split(a.uninterrupted), split(a.resumed)
    print(f"events: uninterrupted {whole_events}; resumed {resumed_events}")
    print("| step | phase | loss | loss (resumed run) | grad norm | grad norm (resumed run) |")
    print("|---|---|---|---|---|---|")
    resume = next((r for r in records if r.get("event") == "resume"), None)
    resume_step = resume["step"] if resume else None
    same, worst = True, {"before": 0.0, "after": 0.0}
    for step in sorted(whole):
        w, r = whole[step], resumed.get(step)
        if r is None or w.get("phase") != r.get("phase"):
            same = False
            print(f"| {step} | {w.get('phase')} | {w['loss']:.6f} | {'missing' if r is None else r.get('phase')} | | |")
            continue
        part = "after" if resume_step is not None and step > resume_step else "before"
        worst[part] = max(worst[part], abs(w["loss"] - r["loss"]) / abs(w["loss"]))
        print(f"| {step} | {w.get('phase')} | {w['loss']:.6f} | {r['loss']:.6f} | "
              f"{w.get('grad_norm', float('nan')):.4f} | {r.get('grad_norm', float('nan')):.4f} |")
    flipped = True
    if a.flip is not None:
        flips = [[s for s, e in events if e == "precision_flip"] for events in (whole_events, resumed_events)]
        flipped = all(a.flip in steps for steps in flips)
        print(f"the flip: {'at' if flipped else 'NOT at'} step {a.flip} in both runs (flip events at {flips})")
    stops = [r for r in records if r.get("event") == "preempted"]
    print(f"the stop: {stops[-1]['tag']} on {stops[-1]['reason']}" if stops else "the stop: no preempted event")
    print(f"the resume: from {resume['tag']} after step {resume_step}" if resume else "the resume: NONE")
    print(f"{len(whole)} steps, {'each' if same else 'NOT each'} in both runs with the same phase; largest relative "
          f"loss difference {worst['before']:.2e} before the resume, {worst['after']:.2e} after it "
          f"(tolerance {a.tolerance:.0e})")
    return 0 if same and flipped and resume is not None and worst["after"] <= a.tolerance else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
