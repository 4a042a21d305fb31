"""Compare an uninterrupted run with one that stopped at a checkpoint and resumed: loss, grad norm and precision
phase step by step, the events of each (the flip, the resume), and the largest relative loss difference before
and after the resume. Exits non-zero when a step is missing, a phase differs, or the resumed run did not resume.

    python benchmarks/device/resume_summary.py RUN_UNINTERRUPTED RUN_RESUMED
"""

import sys

from llmjp_ds.metrics import read_metrics


def split(run):
    records = read_metrics(run)
    return ({r["step"]: r for r in records if "event" not in r},
            [(r["step"], r["event"]) for r in records if "event" in r])


(whole, whole_events), (resumed, resumed_events) = split(sys.argv[1]), split(sys.argv[2])
print(f"events: uninterrupted {whole_events}; resumed {resumed_events}")
print("| step | phase | loss | loss (resumed run) | grad norm | grad norm (resumed run) |")
print("|---|---|---|---|---|---|")
ok, resume_step = True, next((s for s, e in resumed_events if e == "resume"), None)
worst = {"before": 0.0, "after": 0.0}
for step in sorted(whole):
    a, b = whole[step], resumed.get(step)
    if b is None or a.get("phase") != b.get("phase"):
        ok = False
        print(f"| {step} | {a.get('phase')} | {a['loss']:.6f} | {'missing' if b is None else b.get('phase')} | | |")
        continue
    rel = abs(a["loss"] - b["loss"]) / abs(a["loss"])
    part = "after" if resume_step is not None and step > resume_step else "before"
    worst[part] = max(worst[part], rel)
    print(f"| {step} | {a.get('phase')} | {a['loss']:.6f} | {b['loss']:.6f} | {a.get('grad_norm', float('nan')):.4f} "
          f"| {b.get('grad_norm', float('nan')):.4f} |")
print(f"resumed after step {resume_step}; largest relative loss difference before it {worst['before']:.2e}, "
      f"after it {worst['after']:.2e}")
sys.exit(0 if ok and resume_step is not None else 1)
