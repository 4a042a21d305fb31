"""Every FP8 decision of a run, taken in one place: the flip, ``recipe: auto``, FP8's loss penalty and its
fallback, the rollback to BF16 after a divergence.

The trainer calls :class:`PrecisionController` at fixed points of its loop and does what it is told; it never
asks which recipe runs or why:

* :meth:`~PrecisionController.before_step`: ``recipe: auto`` chooses its recipe on the validation batches (the
  flip step of an ``auto`` phase), and the flip is logged; returns the step's phase (``schedule.describe``);
* :meth:`~PrecisionController.validation`: the validation loss in the step's precision and, in an FP8 phase,
  with FP8 off on the same weights and batches (``fp8_penalty``); a penalty too high for ``penalty_patience``
  validations warns, steps down the fallback chain or returns to BF16 (``precision.guard.penalty_action``);
* :meth:`~PrecisionController.after_step`: the divergence guard sees the step's loss and says whether to roll
  back; :meth:`~PrecisionController.rollback_target` names the checkpoint to go back to and
  :meth:`~PrecisionController.rolled_back` continues the run in BF16 from there.

Validation losses come from the caller as functions (``measure()``: the mean validation loss over fixed batches
in whatever precision the schedule's micro-batch context gives now), so nothing here knows DeepSpeed, the data or
the step runner. Events go to ``event(step, kind, **fields)`` (the metrics log) and lines for people to
``say(line)`` (rank 0's stdout). A new guard or action is a change to this package only.
"""

from __future__ import annotations

import math
from typing import Callable

from llmjp_ds.errors import fail
from llmjp_ds.precision.guards import DivergenceGuard, PenaltyMonitor, choose_recipe, penalty
from llmjp_ds.precision.schedule import PrecisionSchedule, fp8_summary

Measure = Callable[[], float]


class PrecisionController:
    """The schedule, the guards that watch it, and the decisions they lead to."""

    def __init__(self, schedule: PrecisionSchedule, cfg, event: Callable[..., None], say: Callable[[str], None]):
        self.schedule, self.cfg = schedule, cfg
        self.guard = DivergenceGuard(cfg.guard)
        self.penalty = PenaltyMonitor(cfg.guard)
        self.event, self.say = event, say

    @property
    def rollbacks(self) -> int:
        return self.schedule.rollbacks

    # --- before a step ----------------------------------------------------------------------------------
    def before_step(self, step: int, open_validation: Callable[[], Measure]) -> dict:
        """The precision of ``step`` (``schedule.describe``), once ``recipe: auto`` has chosen at its flip
        (``open_validation()`` gives the validation's ``measure``; called only when a choice is due)."""
        if self.schedule.choice_pending(step):
            self.choose_recipe(step, open_validation())
        phase = self.schedule.describe(step)
        if self.schedule.is_flip_step(step):
            self.event(step, "precision_flip", **phase)
        return phase

    def choose_recipe(self, step: int, measure: Measure) -> None:
        """``recipe: auto`` at its flip: evaluate each candidate recipe with the current weights on the
        validation batches, flip to the one with the lowest penalty within ``max_penalty`` or stay in BF16."""
        s = self.schedule
        s.begin_step(step)
        with s.forced_bf16():
            bf16 = measure()
        penalties = {}
        for recipe in s.candidates(step):
            with s.trying(step, recipe):
                penalties[recipe] = penalty(measure(), bf16)
            s.commit_amax()
        recipe, why = choose_recipe(penalties, self.cfg.guard.max_penalty)
        s.switch_recipe(step, recipe, f"recipe auto: {why}", calibrate=False)
        self.event(step, "recipe_choice", chosen=recipe, reason=why, valid_loss_bf16=bf16,
                   **{f"penalty_{r}": p for r, p in penalties.items()})
        self.say(f"[llmjp-ds] recipe auto at step {step}: {recipe} ({why})")

    def step_metrics(self, phase: dict) -> dict:
        """What the step's record says of its precision."""
        return {"phase": phase["recipe"], "precision": phase["precision"], "emulated_fp8": phase["emulated"]}

    def amax_metrics(self, model) -> dict:
        """The FP8 amax / scale summary of ``model`` when ``precision.log_amax`` asks for it."""
        return fp8_summary(model) if self.cfg.log_amax else {}

    # --- after a validation -----------------------------------------------------------------------------
    def validation(self, step: int, measure: Measure) -> dict:
        """The validation's losses after ``step`` steps (``valid_loss``; in an FP8 phase also ``valid_loss_bf16``
        and ``fp8_penalty``), and what FP8's penalty asks for."""
        s = self.schedule
        out = {"valid_loss": measure()}
        if s.in_fp8():
            with s.forced_bf16():
                out["valid_loss_bf16"] = measure()
            out["fp8_penalty"] = penalty(out["valid_loss"], out["valid_loss_bf16"])
        s.commit_amax()
        self._watch_penalty(step, out)
        return out

    def _watch_penalty(self, step: int, metrics: dict) -> None:
        """FP8's penalty too high for ``penalty_patience`` validations: warn, fall back along the chain, or BF16."""
        if "fp8_penalty" not in metrics or not self.penalty.observe(metrics["fp8_penalty"]):
            return
        guard = self.cfg.guard
        now = self.schedule.phase_at(step).label
        action = guard.penalty_action
        reason = (f"FP8 penalty {100 * metrics['fp8_penalty']:+.2f}% above max_penalty {100 * guard.max_penalty:.3g}%"
                  f" for {guard.penalty_patience} validation{'s' if guard.penalty_patience > 1 else ''} in a row")
        if action == "warn":
            self.event(step, "fp8_penalty", reason=reason, recipe=now)
        else:
            target = "bf16" if action == "bf16" else self.schedule.next_fallback(step)
            self.schedule.switch_recipe(step, target, reason)
            self.event(step, "precision_fallback", reason=reason, to=target, **{"from": now})
        self.say(f"[llmjp-ds] step {step}: {reason}" + ("" if action == "warn" else f"; from {now} to {target}"))

    # --- on divergence ----------------------------------------------------------------------------------
    def after_step(self, step: int, lm_loss: float, z_loss: float, phase: dict) -> str | None:
        """The guard's verdict on ``step``'s loss: why to roll back (a non-finite loss, a loss spike), or None."""
        if not self.guard.observe(step, lm_loss + z_loss, phase["precision"]):
            return None
        return "non-finite loss" if not math.isfinite(lm_loss) else "loss spike"

    def rollback_target(self, step: int, reason: str, tags: list[tuple[int, str]]) -> tuple[int, str]:
        """The newest of the complete checkpoints ``tags`` ((step, tag), oldest first) saved before the first
        bad step of the divergence seen at ``step`` (a tag's number counts completed steps: tag N holds the state
        before step index N ran)."""
        first_bad = self.guard.first_bad_step if self.guard.first_bad_step is not None else step
        good = [(s, t) for s, t in tags if s <= first_bad]
        if not good:
            fail(f"loss diverged after the FP8 flip ({reason}) and there is no checkpoint before it to roll back "
                 "to: lower checkpoint.interval so one is saved before the flip, or disable the guard")
        return good[-1]

    def rolled_back(self, failed_step: int, good_step: int, good_tag: str, reason: str, client: dict) -> None:
        """The weights of checkpoint ``good_tag`` (its trainer state ``client``) are loaded: the guard resumes
        from them, and from ``good_step`` on every FP8 phase runs in BF16."""
        s = self.schedule
        rollbacks = s.rollbacks + 1
        s.weights_changed()
        self.guard.load_state_dict(client.get("guard", {}))
        s.fallback_from_step, s.rollbacks = good_step, rollbacks
        self.event(failed_step, "rollback", reason=reason, to_step=good_step, tag=good_tag, fallback="bf16")
        self.say(f"[llmjp-ds] FP8 divergence at step {failed_step} ({reason}): rolled back to {good_tag}, "
                 "continuing in BF16")

    # --- state ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What a checkpoint carries of the precision (the keys of the trainer's client state)."""
        return {"precision": self.schedule.state_dict(), "guard": self.guard.state_dict(),
                "penalty": self.penalty.state_dict()}

    def load_state_dict(self, client: dict) -> None:
        self.schedule.load_state_dict(client.get("precision", {}))
        self.guard.load_state_dict(client.get("guard", {}))
        self.penalty.load_state_dict(client.get("penalty", {}))
