"""The CPU trails of every layout the suite trains, against trails recorded from an earlier build.

``recorded_trails.json`` holds, per run, each step's loss, z-loss, grad norm, lr, consumed samples and
precision: the uninterrupted runs of every layout in ``LAYOUTS`` (one process, ZeRO-1/2/3, PP2, PP2 x DP2, and
TP2, TP2 x PP2, TP2 x DP2 with ZeRO-1 and ZeRO-2, recorded when tensor parallelism landed), the resumed runs of
``test_resume``, and the emulated FP8 flip (one process, PP2, PP2 resumed after the flip; fp32 until step
``FLIP_AT``, FP8 after). A refactor of the trainer must not change a single bit of them on a CPU of the kind that
recorded the file (same torch, CPU capability and feature flags). Elsewhere the lr, the consumed samples and the
precision (Python arithmetic on the step) must still be equal, and the loss, z-loss and grad norm (fp32 sums
whose order the CPU's kernels choose) must agree within ``RTOL`` of the step's precision.

``RTOL`` is measured (2026-12-02, torch 2.13.0+cpu, a 2-core Xeon with AVX512 whose flags differ from the
recording CPU's): the largest relative difference from the recorded file, over every run and step, with
``LLMJP_DS_TRAILS_OUT=<file>`` dumping each environment's trails and ``python -m tests.train.test_recorded_trails
<files>`` comparing them::

    environment                      fp32 steps (loss, z-loss, grad norm)   FP8 steps (loss, z-loss, grad norm)
    ATEN_CPU_CAPABILITY=avx512       0, 0, 0                                0, 0, 0
    ATEN_CPU_CAPABILITY=avx2         1.1e-7, 1.2e-7, 2.5e-7                 4.4e-7, 1.2e-7, 1.1e-3
    ATEN_CPU_CAPABILITY=default      1.1e-7, 1.8e-7, 4.2e-7                 2.5e-5, 1.9e-4, 3.7e-3
    2 OpenMP threads a process       1.1e-7, 1.2e-7, 1.7e-7                 0, 0, 8.6e-8

(the resumed runs and the flip's steps before it spread as the uninterrupted fp32 runs; the pytest process's
own thread count does not reach the trainings, which run one thread a process unless ``LLMJP_DS_TEST_THREADS``
says otherwise). The FP8 steps magnify a last-bit difference: one element rounds to another FP8 value and the
gap grows from there. So fp32 steps get ``1e-5`` (24x the largest spread) and FP8 steps 10x theirs.

Planted regressions, each run through this test (the largest relative difference of each group, and whether
the test caught it there):

    plant                                    fp32 runs        flip before FP8   flip FP8 steps      exact fields
    cosine decay made linear                 1.9e-2 caught    0                 1.3e-2 caught       lr
    z-loss dropped from the objective        2.3e-3 caught    4.1e-5 caught     9.2e-3 not caught   -
    the data one step late (from step 2)     3.2e-1 caught    5.5e-2 caught     3.1e-1 caught       -
    the flip one step late                   0                0                 1.0e-2 not caught   precision

A dropped z-loss hides in the FP8 steps' spread (2.5x it), and is caught by the flip's fp32 steps before it and
by every fp32 run. The FP8 trails of other layouts are also held to the session's own one-process flip run
(``test_flip_layouts``: PP2 and a resume after the flip within 1e-5 of it).

To record afresh after a change that is meant to move the numbers::

    LLMJP_DS_RECORD_TRAILS=1 python -m pytest tests/train/test_recorded_trails.py
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from tests.runs import LAYOUTS, trail

pytestmark = pytest.mark.slow

RECORDED = Path(__file__).with_name("recorded_trails.json")
FIELDS = ("loss", "z_loss", "grad_norm", "lr", "consumed_samples", "precision")
EXACT = ("lr", "consumed_samples", "precision")  # computed in Python from the step: equal on every machine
MEASURED = ("loss", "z_loss", "grad_norm")  # fp32 sums whose order the CPU's kernels choose
RESUMED = ("single", "zero2", "pp2")
# a step's precision -> the relative tolerance of its MEASURED fields on a machine of another kind than the
# recording one (the module docstring has the measured spread behind each)
RTOL = {"fp32": dict.fromkeys(MEASURED, 1e-5), "fp8": {"loss": 2.5e-4, "z_loss": 2e-3, "grad_norm": 4e-2}}


def _machine() -> dict:
    """What fixes the bits of an fp32 CPU run: torch, the kernels' ISA, and the CPU's feature flags (two CPUs
    that both report AVX512 still sum some reductions in another order)."""
    import hashlib

    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_flags": hashlib.sha256(" ".join(sorted(flags.split(":")[-1].split())).encode()).hexdigest()[:16]}


def _trails(runs, flip_runs) -> dict[str, list[dict]]:
    dirs = {f"full/{layout}": runs.full(layout) for layout in LAYOUTS}
    dirs.update({f"resumed/{layout}": runs.resumed(layout) for layout in RESUMED})
    dirs.update(zip(("flip/single", "flip/pp2", "flip/pp2-resumed"), flip_runs))
    return {name: [{k: r[k] for k in FIELDS} for r in trail(d)] for name, d in dirs.items()}


def _precision(step: dict) -> str:
    return "fp8" if step["precision"] == "fp8" else "fp32"


def spread(got: dict, recorded: dict) -> dict[str, dict[str, float]]:
    """The largest relative difference of the MEASURED fields between two sets of trails of the same runs, by
    kind of run and recorded precision of the step: ``{"flip/fp8": {field: max |a - b| / |b|}, ...}``."""
    out: dict[str, dict[str, float]] = {}
    for name, steps in recorded.items():
        for mine, theirs in zip(got.get(name, []), steps):
            group = out.setdefault(f"{name.split('/')[0]}/{_precision(theirs)}", dict.fromkeys(MEASURED, 0.0))
            for key in MEASURED:
                group[key] = max(group[key], abs(mine[key] - theirs[key]) / max(abs(theirs[key]), 1e-30))
    return dict(sorted(out.items()))


def mismatches(got: dict, recorded: dict, exact: bool) -> list[str]:
    """Every step and field where ``got`` leaves the recorded trails: EXACT fields must be equal everywhere,
    MEASURED ones equal on the recording kind of machine (``exact``) and within the RTOL of the step's recorded
    precision elsewhere."""
    bad = [] if sorted(got) == sorted(recorded) else [f"runs {sorted(got)}, recorded {sorted(recorded)}"]
    for name, steps in recorded.items():
        mine_steps = got.get(name, [])
        if len(mine_steps) != len(steps):
            bad.append(f"{name}: {len(mine_steps)} steps, recorded {len(steps)}")
            continue
        for i, (mine, theirs) in enumerate(zip(mine_steps, steps), 1):
            for key in FIELDS:
                a, b = mine[key], theirs[key]
                same = a == b if exact or key in EXACT else math.isclose(
                    a, b, rel_tol=RTOL[_precision(theirs)][key], abs_tol=1e-12)
                if not same:
                    bad.append(f"{name} step {i} {key}: {a!r}, recorded {b!r}")
    return bad


@pytest.mark.timeout(1800)
def test_trails_match_the_recorded_build(runs, flip_runs):
    got = _trails(runs, flip_runs)
    if os.environ.get("LLMJP_DS_RECORD_TRAILS"):
        RECORDED.write_text(json.dumps({"machine": _machine(), "trails": got}, indent=1) + "\n")
        pytest.skip(f"recorded {RECORDED}")
    dump = os.environ.get("LLMJP_DS_TRAILS_OUT")  # this machine's trails, to measure the spread (see above)
    if dump:
        Path(dump).write_text(json.dumps({"machine": _machine(), "trails": got}, indent=1) + "\n")
    recorded = json.loads(RECORDED.read_text())
    exact = recorded["machine"] == _machine()
    bad = mismatches(got, recorded["trails"], exact)
    where = "the recording machine's kind: bit for bit" if exact else f"another kind of machine: within {RTOL}"
    assert not bad, (f"{len(bad)} values leave the recorded trails ({where}); the spread by kind is "
                     f"{spread(got, recorded['trails'])}:\n" + "\n".join(bad[:20]))


def main(paths: list[str]) -> None:
    """``python -m tests.train.test_recorded_trails DUMP...``: each dump's spread from the recorded trails."""
    recorded = json.loads(RECORDED.read_text())["trails"]
    for path in paths:
        dumped = json.loads(Path(path).read_text())
        table = spread(dumped["trails"], recorded)
        print(path, dumped["machine"]["cpu_capability"], " | ".join(
            f"{group}: " + ", ".join(f"{k} {v:.1e}" for k, v in fields.items()) for group, fields in table.items()))
        for line in mismatches(dumped["trails"], recorded, exact=False)[:5]:
            print("   ", line)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
