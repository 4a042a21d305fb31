"""``llmjp-ds health RUN_DIR [--plot [FILE]]``: what happened to a run's health, from its metrics log and its latest
checkpoint: spikes and what was done about them, skipped updates and steps, rollbacks, stops, FP8's penalty and
fallbacks, precision flips, batch and data-phase changes, resumes and branches, as one table; ``--plot`` marks them
on the loss curve.

The log is read whole, every attempt of the run (metrics/record.py): the events of a timeline a rollback or a
resume went back over are kept and listed, and each step counts once, as its current record."""

from __future__ import annotations

import argparse
from pathlib import Path

from llmjp_ds.checkpoint.store import latest_tag, read_marker
from llmjp_ds.errors import fail
from llmjp_ds.metrics.record import changes, current_steps, events as events_of, read_metrics
from llmjp_ds.metrics.plot import plot_run

# the events the report lists, and how each reads in one cell
HEALTH_EVENTS = ("health", "rollback", "stop", "skipped_step", "precision_flip", "precision_fallback",
                 "recipe_choice", "fp8_penalty", "resume", "reshape", "checkpoint_fallback", "branch", "preempted",
                 "batch_change", "data_phase")


def _number(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def describe(event: dict) -> tuple[str, str]:
    """(what, detail) of one event record."""
    kind = event["event"]
    if kind == "health":
        action = f"stop ({event['limit']} reached)" if event.get("limit") else event.get("action", "?")
        if event.get("kind") == "router":
            return "router collapse", (f"{action}: {event.get('where', '?')} got no token for "
                                       f"{_number(event.get('value', '?'))} steps")
        stats = ", ".join(f"{k} {_number(event[k])}" for k in ("value", "median", "z") if k in event)
        return f"{event.get('kind', '?')} spike" if event.get("kind") != "nonfinite" else "non-finite step", \
            f"{action}: {stats}"
    if kind == "stop":
        return "the run stopped", f"{event.get('reason', '')} (latest checkpoint: {event.get('latest') or 'none'})"
    if kind == "rollback":
        skipped = event.get("skipped_steps")
        return "rollback", (f"to {event.get('tag')} (step {event.get('to_step')})"
                            + (f", steps {skipped[0]}..{skipped[1]} skipped" if skipped else "")
                            + (f", {event['fallback']} from there" if event.get("fallback") else "")
                            + f": {event.get('reason', '')}")
    if kind == "precision_flip":
        return "precision flip", f"{event.get('precision')} ({event.get('recipe')})"
    if kind == "precision_fallback":
        return "FP8 fallback", f"{event.get('from')} -> {event.get('to')}: {event.get('reason')}"
    if kind == "fp8_penalty":
        return "FP8 penalty", f"{event.get('recipe')}: {event.get('reason')}"
    if kind == "branch":
        return "branch", f"from {event.get('from_run')} at {event.get('from_tag')}"
    if kind == "batch_change":
        return "batch change", f"global batch {event.get('from')} -> {event.get('global_batch_size')}"
    if kind == "data_phase":
        return "data phase", f"phase {event.get('from')} -> {event.get('data_phase')} (data.phases)"
    fields = {k: v for k, v in event.items() if k not in ("step", "time", "event", "attempt")}
    return kind.replace("_", " "), ", ".join(f"{k} {_number(v)}" for k, v in fields.items())


def _merged(events: list[dict], step_changes: list[dict]) -> list[dict]:
    """``events`` in file order (every attempt's), each change of ``step_changes`` (in step order) before the first
    event of a later step."""
    out, pending = [], list(step_changes)
    for event in events:
        while pending and pending[0]["step"] <= event["step"]:
            out.append(pending.pop(0))
        out.append(event)
    return out + pending


def report(run_dir) -> list[str]:
    """The table's lines (markdown), then the counts: steps, rollbacks, stops, skipped updates, and the steps whose
    samples were not trained on (its latest checkpoint's record, each window with the rollback that made it)."""
    records = read_metrics(run_dir)
    current = current_steps(records)
    events = _merged(events_of(records, HEALTH_EVENTS), changes(current))
    steps = [r for r in current.values() if "loss" in r]
    lines = ["| step | what | detail |", "| ---: | --- | --- |"]
    lines += [f"| {e['step']} | {what} | {detail} |" for e in events for what, detail in [describe(e)]]
    skipped_updates = steps[-1].get("skipped_steps", 0) if steps else 0
    tag = latest_tag(run_dir)
    ranges = (read_marker(run_dir, tag).skip_steps or []) if tag else []
    made = {tuple(e["skipped_steps"]): e["step"] for e in events if e["event"] == "rollback" and e.get("skipped_steps")}
    windows = [f"{a}..{b}" + (f" (rollback at step {made[(a, b)]})" if (a, b) in made else " (train.skip_steps)")
               for a, b in ranges]
    rollbacks, stops = (sum(e["event"] == name for e in events) for name in ("rollback", "stop"))
    lines += ["", f"{len(steps)} steps logged, {rollbacks} rollbacks"
              f"{f', {stops} stops' if stops else ''}, {skipped_updates} updates skipped; steps whose samples were "
              "not trained on: " + (", ".join(windows) or "none")]
    return lines


def cli_main(argv: list[str], verb: str = "health") -> int:
    p = argparse.ArgumentParser(prog=f"llmjp-ds {verb}", description=__doc__.split("\n\n")[0])  # its first paragraph
    p.add_argument("run", metavar="RUN_DIR", help="the run directory")
    p.add_argument("--plot", nargs="?", const="", metavar="FILE",
                   help="also draw the loss curve with these events marked (default RUN_DIR/health.png)")
    a = p.parse_args(argv)
    run_dir = Path(a.run)
    if not run_dir.is_dir():
        fail(f"run directory {run_dir} does not exist: pass the run_dir of a training run")
    print("\n".join(report(run_dir)))
    if a.plot is not None:
        out = plot_run(run_dir, a.plot or run_dir / "health.png", events=HEALTH_EVENTS, option="--plot")
        print(f"wrote {out}")
    return 0
