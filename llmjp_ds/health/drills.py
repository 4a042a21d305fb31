"""Fault drills for tests and rehearsals, set from the environment (never from the run config):

* ``LLMJP_DS_DRILL_NAN_STEPS=3,4``: the losses of those steps (numbered from 1, as the records show them) are NaN,
  so their gradients are too;
* ``LLMJP_DS_DRILL_NAN_PHASE=fp8`` (default: only in FP8 phases, to rehearse the divergence guard) or ``any``
  (to rehearse skipped steps);
* ``LLMJP_DS_DRILL_FP8_PENALTY=0.05``: validation losses measured in FP8 come out 5 % higher, so FP8's measured
  penalty rises by that much (to rehearse the penalty guard's actions);
* ``LLMJP_DS_DRILL_SPIKE_STEPS=5,9`` with ``LLMJP_DS_DRILL_SPIKE_SCALE=20`` (default 20): a planted spike at those
  steps, the first time a process runs each (a step that a rollback brings back runs clean, as after bad data
  skipped), ``LLMJP_DS_DRILL_SPIKE_ON=loss`` (default: the loss and its gradients are that many times larger),
  ``grad`` (the gradients alone) or ``lr`` (the step's LR: a real cause, whose spike shows in the loss of the steps
  after), to rehearse the health monitor's actions (:mod:`llmjp_ds.health.monitor`).

A drill wraps the step runner; the runner itself only multiplies its loss by the ``loss_scale`` it is stepped with
(and its gradients by ``grad_scale``). Each drill multiplies those it is handed for its step, so drills compose (a
planted spike and a NaN in one run).
"""

from __future__ import annotations

import os

from llmjp_ds.errors import fail

STEPS_VAR = "LLMJP_DS_DRILL_NAN_STEPS"
PHASE_VAR = "LLMJP_DS_DRILL_NAN_PHASE"
PENALTY_VAR = "LLMJP_DS_DRILL_FP8_PENALTY"
SPIKE_STEPS_VAR, SPIKE_SCALE_VAR, SPIKE_ON_VAR = ("LLMJP_DS_DRILL_SPIKE_STEPS", "LLMJP_DS_DRILL_SPIKE_SCALE",
                                                  "LLMJP_DS_DRILL_SPIKE_ON")


class RunnerDrill:
    """A step runner wrapped: what it does not change is the runner's."""

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def train_step(self, batches, gate=None, loss_scale: float = 1.0, grad_scale: float = 1.0):
        return self.runner.train_step(batches, gate, loss_scale, grad_scale)


class NanDrill(RunnerDrill):
    """A step runner whose chosen steps' losses are NaN."""

    def __init__(self, runner, precision, steps: set[int], any_phase: bool):
        self.runner, self.precision, self.steps, self.any_phase = runner, precision, steps, any_phase

    def train_step(self, batches, gate=None, loss_scale: float = 1.0, grad_scale: float = 1.0):
        step = self.precision.step
        drilled = step in self.steps and (self.any_phase or self.precision.phase_at(step).precision == "fp8")
        return self.runner.train_step(batches, gate, loss_scale * (float("nan") if drilled else 1.0), grad_scale)


class PenaltyDrill(RunnerDrill):
    """A step runner whose validation losses in FP8 are ``1 + extra`` times the measured ones."""

    def __init__(self, runner, precision, extra: float):
        self.runner, self.precision, self.extra = runner, precision, extra

    def eval_loss(self, batches):
        loss = self.runner.eval_loss(batches)
        return loss * (1.0 + self.extra) if self.precision.in_fp8() else loss


class SpikeDrill(RunnerDrill):
    """A step runner whose chosen steps' loss (and gradients), gradients alone, or LR are ``scale`` times larger."""

    def __init__(self, runner, precision, steps: set[int], scale: float, on: str):
        self.runner, self.precision, self.steps, self.scale, self.on = runner, precision, steps, scale, on

    def train_step(self, batches, gate=None, loss_scale: float = 1.0, grad_scale: float = 1.0):
        step = self.precision.step
        drilled = self.scale if step in self.steps else 1.0
        self.steps = self.steps - {step}  # once a process: the step a rollback brings back finds clean data
        if self.on == "lr" and drilled != 1.0:  # the step's LR, set just before: a real cause, for real weights
            for group in self.runner.engine.optimizer.param_groups:
                group["lr"] *= drilled
        return self.runner.train_step(batches, gate, loss_scale * (drilled if self.on == "loss" else 1.0),
                                      grad_scale * (drilled if self.on == "grad" else 1.0))


def with_drills(runner, precision):
    """``runner``, wrapped in the drills the environment asks for (if any)."""
    runner = _spike_drill(_nan_drill(runner, precision), precision)
    extra = os.environ.get(PENALTY_VAR, "").strip()
    if extra:
        try:
            runner = PenaltyDrill(runner, precision, float(extra))
        except ValueError:
            fail(f"{PENALTY_VAR}={extra!r} must be a number, e.g. 0.05")
    return runner


def _steps(var: str) -> set[int]:
    raw = os.environ.get(var, "").strip()
    try:
        return {int(s) for s in raw.replace(" ", "").split(",") if s}
    except ValueError:
        fail(f"{var}={raw!r} must be a comma list of step numbers, e.g. 3,4")


def _spike_drill(runner, precision):
    steps = _steps(SPIKE_STEPS_VAR)
    if not steps:
        return runner
    raw, on = os.environ.get(SPIKE_SCALE_VAR, "20").strip(), os.environ.get(SPIKE_ON_VAR, "loss")
    try:
        scale = float(raw)
    except ValueError:
        fail(f"{SPIKE_SCALE_VAR}={raw!r} must be a number, e.g. 20")
    if on not in ("loss", "grad", "lr"):
        fail(f"{SPIKE_ON_VAR}={on!r} must be loss, grad or lr")
    return SpikeDrill(runner, precision, steps, scale, on)


def _nan_drill(runner, precision):
    steps = _steps(STEPS_VAR)
    if not steps:
        return runner
    phase = os.environ.get(PHASE_VAR, "fp8")
    if phase not in ("fp8", "any"):
        fail(f"{PHASE_VAR}={phase!r} must be fp8 or any")
    return NanDrill(runner, precision, steps, phase == "any")
