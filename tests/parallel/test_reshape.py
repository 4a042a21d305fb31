"""Resume on another layout: a checkpoint written at one data-parallel size, pipeline depth and tensor-parallel
size continues at another (DP2 -> DP1, DP1 -> DP2, PP2 -> PP1, PP1 -> PP2, TP2 -> TP1, TP1 -> TP2,
TP2 x PP2 -> TP2 x DP2; ZeRO-1), the user only relaunching with the new layout.

The first N steps run on one layout, the next N on another, from the same run directory; the trail must be the
uninterrupted one-process run's within the equivalence tolerances (the layouts differ only in fp32 summation
order), consumed samples included, with a ``reshape`` event at the switch. After the emulated FP8 flip the
amax histories must carry over as well: PP2 -> one process continues the flip run's trail. (A ZeRO-2 checkpoint
on another layout is refused in one line: tests/reliability/test_multi_rank_failures.py.)
"""

from __future__ import annotations

import shutil

import pytest

from llmjp_ds.metrics.record import read_metrics

from tests.runs import FLIP, LAYOUTS, N, STEPS, max_rel_diff, run_train, trail
from tests.train.test_equivalence import GRAD_NORM_RTOL, LOSS_RTOL

pytestmark = pytest.mark.slow

SWITCHES = [("zero1", "single"), ("single", "zero1"), ("pp2", "single"), ("single", "pp2"),
            # tensor parallelism: the conversion merges the TP shards, the new layout takes its own
            ("tp2", "single"), ("single", "tp2"), ("tp2-pp2", "tp2-dp2")]


@pytest.fixture(scope="module")
def first_halves(train_env, tmp_path_factory):
    """N steps on each starting layout (each forked per switch, so the halves are trained once)."""
    root = tmp_path_factory.mktemp("reshape-first")
    out = {}
    for layout in sorted({a for a, _ in SWITCHES}):
        nproc, sets = LAYOUTS[layout]
        out[layout] = run_train(root / layout, nproc, *sets, f"train.steps={N}")
    nproc, sets = LAYOUTS["pp2"]
    out["pp2-flip"] = run_train(root / "pp2-flip", nproc, *sets, *FLIP, f"train.steps={N}")
    return out


def _continue(first, tmp_path, layout: str, *more: str):
    """A copy of the first half's run directory, resumed on ``layout`` to 2N steps."""
    shutil.copytree(first.parent, tmp_path / "fork")
    nproc, sets = LAYOUTS[layout]
    return run_train(tmp_path / "fork", nproc, *sets, *more, f"train.steps={STEPS}")


def _assert_continues(run_dir, reference, saved: str, now: str) -> None:
    ref, got = trail(reference), trail(run_dir)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["consumed_samples"] for r in got] == [r["consumed_samples"] for r in ref]
    loss = max_rel_diff([r["loss"] for r in got], [r["loss"] for r in ref])
    gnorm = max_rel_diff([r["grad_norm"] for r in got], [r["grad_norm"] for r in ref])
    assert loss <= LOSS_RTOL and gnorm <= GRAD_NORM_RTOL, (loss, gnorm)
    events = [r for r in read_metrics(run_dir) if r.get("event") == "reshape"]
    assert [(e["step"], e["saved"], e["now"]) for e in events] == [(N, saved, now)]


NAMES = {"single": "PP1 x DP1", "zero1": "PP1 x DP2", "pp2": "PP2 x DP1", "tp2": "TP2 x PP1 x DP1",
         "tp2-pp2": "TP2 x PP2 x DP1", "tp2-dp2": "TP2 x PP1 x DP2"}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("start,then", SWITCHES, ids=[f"{a}-to-{b}" for a, b in SWITCHES])
def test_a_checkpoint_resumes_on_another_layout(first_halves, runs, tmp_path, start, then):
    run_dir = _continue(first_halves[start], tmp_path, then)
    _assert_continues(run_dir, runs.full("single"), NAMES[start], NAMES[then])


@pytest.mark.timeout(900)
def test_fp8_state_carries_over_a_reshape_after_the_flip(first_halves, flip_runs, tmp_path):
    """PP2 -> one process after the flip: the amax histories of every layer (both stages' files) continue."""
    run_dir = _continue(first_halves["pp2-flip"], tmp_path, "single", *FLIP)
    _assert_continues(run_dir, flip_runs[0], "PP2 x DP1", "PP1 x DP1")
    assert [r["precision"] for r in trail(run_dir)][N:] == ["fp8"] * (STEPS - N)
