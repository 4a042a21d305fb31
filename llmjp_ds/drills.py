"""Fault drills for tests and rehearsals, set from the environment (never from the run config):

* ``LLMJP_DS_DRILL_NAN_STEPS=3,4``: the losses of those step indices are NaN, so their gradients are too;
* ``LLMJP_DS_DRILL_NAN_PHASE=fp8`` (default: only in FP8 phases, to rehearse the divergence guard) or ``any``
  (to rehearse skipped steps);
* ``LLMJP_DS_DRILL_FP8_PENALTY=0.05``: validation losses measured in FP8 come out 5 % higher, so FP8's measured
  penalty rises by that much (to rehearse the penalty guard's actions).

A drill wraps the step runner; the runner itself only multiplies its loss by ``loss_scale``.
"""

from __future__ import annotations

import os

from llmjp_ds.errors import fail

STEPS_VAR = "LLMJP_DS_DRILL_NAN_STEPS"
PHASE_VAR = "LLMJP_DS_DRILL_NAN_PHASE"
PENALTY_VAR = "LLMJP_DS_DRILL_FP8_PENALTY"


class NanDrill:
    """A step runner whose chosen steps' losses are NaN."""

    def __init__(self, runner, precision, steps: set[int], any_phase: bool):
        self.runner, self.precision, self.steps, self.any_phase = runner, precision, steps, any_phase

    def train_step(self, batches):
        step = self.precision.step
        drilled = step in self.steps and (self.any_phase or self.precision.phase_at(step).precision == "fp8")
        self.runner.loss_scale = float("nan") if drilled else 1.0
        return self.runner.train_step(batches)

    def __getattr__(self, name):
        return getattr(self.runner, name)


class PenaltyDrill:
    """A step runner whose validation losses in FP8 are ``1 + extra`` times the measured ones."""

    def __init__(self, runner, precision, extra: float):
        self.runner, self.precision, self.extra = runner, precision, extra

    def eval_loss(self, batches):
        loss = self.runner.eval_loss(batches)
        return loss * (1.0 + self.extra) if self.precision.in_fp8() else loss

    def __getattr__(self, name):
        return getattr(self.runner, name)


def with_drills(runner, precision):
    """``runner``, wrapped in the drills the environment asks for (if any)."""
    runner = _nan_drill(runner, precision)
    extra = os.environ.get(PENALTY_VAR, "").strip()
    if extra:
        try:
            runner = PenaltyDrill(runner, precision, float(extra))
        except ValueError:
            fail(f"{PENALTY_VAR}={extra!r} must be a number, e.g. 0.05")
    return runner


def _nan_drill(runner, precision):
    raw = os.environ.get(STEPS_VAR, "").strip()
    if not raw:
        return runner
    try:
        steps = {int(s) for s in raw.replace(" ", "").split(",") if s}
    except ValueError:
        fail(f"{STEPS_VAR}={raw!r} must be a comma list of step indices, e.g. 3,4")
    phase = os.environ.get(PHASE_VAR, "fp8")
    if phase not in ("fp8", "any"):
        fail(f"{PHASE_VAR}={phase!r} must be fp8 or any")
    return NanDrill(runner, precision, steps, phase == "any")
