"""The BF16 -> FP8 flip (emulated FP8, fp32 master math) under two pipeline stages, against one process.

Under pipeline parallelism the FP8 autocast is entered per micro-batch inside each stage's forward
(``PipelineModule`` subclass in ``model/pipeline_layers.py``) and the amax reduction group is the stage's data-parallel
group. With one data-parallel rank per stage every layer sees the same micro-batches as in the one-process run,
so its amax history, its scales and the quantised GEMMs are the same, in whatever order the 1F1B schedule
interleaves forwards and backwards (the emulation rolls forward and backward histories separately, as TE
does; rolling them together made the pipeline's first FP8 backward use other scales, 8e-5 off by step 6):
the trails must agree to fp32 summation order (``LOSS_RTOL`` of ``test_equivalence``) through the flip. A resume
after the flip (the amax histories travel in the pipeline's per-layer checkpoint files) must repeat the
uninterrupted pipeline run exactly.
"""

from __future__ import annotations

import pytest

from tests.runs import BF16_STEPS, N, STEPS, max_rel_diff, trail
from .test_equivalence import LOSS_RTOL

pytestmark = pytest.mark.slow

@pytest.mark.timeout(900)
def test_flip_under_two_pipeline_stages_trains_as_one_process(flip_runs, runs):
    single, pp2, _ = flip_runs
    ref, got = trail(single), trail(pp2)
    precisions = [r["precision"] for r in ref]
    assert precisions == ["fp32"] * BF16_STEPS + ["fp8"] * (STEPS - BF16_STEPS)  # the base phase runs at precision.dtype
    assert [r["precision"] for r in got] == precisions
    loss = max_rel_diff([r["loss"] for r in got], [r["loss"] for r in ref])
    assert loss <= LOSS_RTOL, f"pipeline flip trail differs from one process by {loss:.2e} (relative)"
    # the flip is real: without it the FP8 steps' losses land 1.5e-4 away, so a pipeline stage running its
    # micro-batches outside the FP8 region would fail the comparison above
    base = [r["loss"] for r in trail(runs.full("single"))]
    assert [r["loss"] for r in ref][:BF16_STEPS] == base[:BF16_STEPS]
    assert max_rel_diff([r["loss"] for r in ref][BF16_STEPS:], base[BF16_STEPS:]) > 10 * LOSS_RTOL


@pytest.mark.timeout(900)
def test_resume_after_the_flip_under_two_pipeline_stages_is_exact(flip_runs):
    _, pp2, resumed = flip_runs
    a, b = trail(pp2), trail(resumed)
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", "lr", "precision"):
        assert [r[key] for r in b] == [r[key] for r in a], f"{key} differs after resuming at step {N}"
