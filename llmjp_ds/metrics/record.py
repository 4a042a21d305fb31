"""A run's record read back: ``metrics.jsonl`` across the attempts that wrote it.

The record only grows. Each process that trains a run, and each rollback inside one, is an *attempt*: every record
it writes carries ``attempt`` (1 for a run's first process), and an attempt that goes on from a checkpoint begins
with an ``attempt`` event at that checkpoint's step. A step record of an earlier attempt after that step is
superseded (the run went back over it) and stays in the file, marked by its attempt; events are never superseded.
Readers take every event and the current record of each step (:func:`current_steps`).

Records written before attempts existed carry none and count as attempt 1.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from llmjp_ds.errors import fail

METRICS_FILE = "metrics.jsonl"
ATTEMPT_EVENT = "attempt"
_TAIL_BYTES = 1 << 16  # enough for the last records of any run


def parse_records(data: bytes) -> tuple[list[dict], int]:
    """The records of a metrics.jsonl's bytes in file order, and how many non-blank lines were skipped: a line
    cut short by a killed run, bytes that are not UTF-8 or not JSON, a value that is not an object with an
    integer step."""
    records, skipped = [], 0
    for raw in data.splitlines():
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            skipped += 1
            continue
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            skipped += 1
            continue
        records.append(record)
    return records, skipped


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """Every record of ``<run_dir>/metrics.jsonl`` in file order, of every attempt (unreadable lines, such as a
    torn last one, skipped)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        fail(f"no {METRICS_FILE} in {run_dir}: is it a run directory, and has the run logged a step yet?")
    return parse_records(path.read_bytes())[0]


def attempt_of(record: dict) -> int:
    value = record.get("attempt")
    return value if isinstance(value, int) and not isinstance(value, bool) else 1


def last_attempt(path: Path) -> int:
    """The attempt of the last readable record of the metrics file at ``path`` (0: no file, or no record)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - _TAIL_BYTES))
            records = parse_records(f.read())[0]
            if not records and size > _TAIL_BYTES:  # one line longer than the tail: read it all
                f.seek(0)
                records = parse_records(f.read())[0]
    except FileNotFoundError:
        return 0
    return max((attempt_of(r) for r in records), default=0)


def current_steps(records: list[dict]) -> dict[int, dict]:
    """Step by step, the record each step holds now (events left out): of the attempts that logged a step, the
    latest that no later attempt went back over (several records of one step in that attempt are merged, the later
    winning)."""
    starts: dict[int, int] = {}  # attempt -> the step it went on from
    for record in records:
        if record.get("event") == ATTEMPT_EVENT:
            starts[attempt_of(record)] = record["step"]
    attempts = sorted({attempt_of(r) for r in records}, reverse=True)
    kept_up_to, running = {}, math.inf  # attempt -> its last step that no later attempt went back over
    for attempt in attempts:
        kept_up_to[attempt] = running
        running = min(running, starts.get(attempt, math.inf))
    steps: dict[int, dict] = {}
    for record in records:
        if "event" not in record and record["step"] <= kept_up_to[attempt_of(record)]:
            steps.setdefault(record["step"], {}).update(record)
    return dict(sorted(steps.items()))


# a step record's fields whose change is an event of its own: the field, the event's name
CHANGES = (("global_batch_size", "batch_change"), ("data_phase", "data_phase"))


def changes(steps: dict[int, dict]) -> list[dict]:
    """The batch and data-phase changes of a run's current step records (:func:`current_steps`) as events, in step
    order: ``batch_change`` at the first step of a new global batch size, ``data_phase`` at the first step of
    another data phase, each with its value and the one before (``from``)."""
    out, last = [], {}
    for step, record in steps.items():
        for key, name in CHANGES:
            if key not in record:
                continue
            if key in last and record[key] != last[key]:
                out.append({"step": step, "event": name, key: record[key], "from": last[key]})
            last[key] = record[key]
    return out


def events(records: list[dict], names=None) -> list[dict]:
    """The event records in file order (``names``: only those), of every attempt."""
    return [r for r in records if "event" in r and (names is None or r["event"] in names)]


def trail(run_dir: str | os.PathLike) -> list[dict]:
    """The current step records of a run that logged a loss, in step order: its training curve as it stands."""
    return [r for r in current_steps(read_metrics(run_dir)).values() if "loss" in r]
