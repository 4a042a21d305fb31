"""The CPU trails of every layout the suite trains, against trails recorded from an earlier build.

``recorded_trails.json`` holds, per run, each step's loss, z-loss, grad norm, lr, consumed samples and
precision: the uninterrupted runs of every layout in ``LAYOUTS`` (one process, ZeRO-1/2/3, PP2, PP2 x DP2, and
TP2, TP2 x PP2, TP2 x DP2 with ZeRO-1 and ZeRO-2, recorded when tensor parallelism landed), the resumed runs of
``test_resume``, and the emulated FP8 flip (one process, PP2, PP2 resumed after the flip). A
refactor of the trainer must not change a single bit of them: on a CPU of the kind that recorded the file
(same torch version and CPU capability) the values must be equal; elsewhere fp32 kernels may sum in another
order, and the trails must agree within ``FOREIGN_RTOL``. (The CPU's feature flags are part of the machine: on
2026-12-01 a CPU that also reported AVX512 gave a z-loss 1 ulp away at step 3, from both the previous build and
this one.)

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
RESUMED = ("single", "zero2", "pp2")
FOREIGN_RTOL = 1e-5


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


def _close(a, b) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return math.isclose(a, b, rel_tol=FOREIGN_RTOL, abs_tol=1e-12)


@pytest.mark.timeout(1800)
def test_trails_match_the_recorded_build(runs, flip_runs):
    got = _trails(runs, flip_runs)
    if os.environ.get("LLMJP_DS_RECORD_TRAILS"):
        RECORDED.write_text(json.dumps({"machine": _machine(), "trails": got}, indent=1) + "\n")
        pytest.skip(f"recorded {RECORDED}")
    recorded = json.loads(RECORDED.read_text())
    assert sorted(got) == sorted(recorded["trails"])
    exact = recorded["machine"] == _machine()
    for name, steps in recorded["trails"].items():
        assert len(got[name]) == len(steps), f"{name}: {len(got[name])} steps, recorded {len(steps)}"
        for i, (mine, theirs) in enumerate(zip(got[name], steps), 1):
            for key in FIELDS:
                same = mine[key] == theirs[key] if exact else _close(mine[key], theirs[key])
                assert same, f"{name} step {i} {key}: {mine[key]!r}, recorded {theirs[key]!r}"
