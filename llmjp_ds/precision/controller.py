"""Every FP8 decision of a run, taken in one place: the flip, ``recipe: auto``, FP8's loss penalty and its
fallback, the rollback to BF16 after a divergence.

The trainer's loop asks :class:`PrecisionController` at fixed points and does what it is told; it never asks which
recipe runs or why:

* :meth:`~PrecisionController.before_step`: the step's phase (``schedule.describe``), the flip logged; when
  ``recipe: auto`` is due (:meth:`~PrecisionController.choice_due`), :meth:`~PrecisionController.choose_recipe`
  chooses on the validation batches;
* :meth:`~PrecisionController.validation`: the validation loss in the step's precision and, in an FP8 phase, with
  FP8 off on the same weights and batches (``fp8_penalty``); a penalty too high for ``penalty_patience``
  validations warns, steps down the fallback chain or returns to BF16 (``precision.guard.penalty_action``);
* :meth:`~PrecisionController.after_step`: the divergence guard sees the step's loss and says from which step
  the run must go back (the loop rolls back, the same way as for a training-health rollback);
  :meth:`~PrecisionController.rolled_back` continues the run in BF16 from there.

``choose_recipe`` and ``validation`` are generators: each yields once per loss it needs, inside the precision
context that loss is measured in, and the loop sends the measured loss back
(``trainer.heldout_loss.Evaluator.decide``), so nothing here knows DeepSpeed, the data or the step runner. Events go
to ``event(step, kind, **fields)`` (the metrics log) and lines for people to ``say(line)`` (rank 0's stdout). A new
guard or action is a change to this package only."""

from __future__ import annotations

import math
from typing import Callable, Iterator

from llmjp_ds.precision.guards import DivergenceGuard, PenaltyMonitor, choose_recipe, penalty
from llmjp_ds.precision.schedule import PrecisionSchedule, fp8_summary


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
    def choice_due(self, step: int) -> bool:
        """Whether ``recipe: auto`` chooses its recipe before ``step`` (:meth:`choose_recipe`)."""
        return self.schedule.choice_pending(step)

    def before_step(self, step: int) -> dict:
        """The precision of ``step`` (``schedule.describe``); the flip is logged."""
        phase = self.schedule.describe(step)
        if self.schedule.is_flip_step(step):
            self.event(step, "precision_flip", **phase)
        return phase

    def choose_recipe(self, step: int) -> Iterator[None]:
        """``recipe: auto`` at its flip (a generator of the losses it needs): each candidate recipe with the
        current weights on the validation batches, then the flip to the one with the lowest penalty within
        ``max_penalty``, or BF16."""
        s = self.schedule
        s.begin_step(step)
        with s.forced_bf16():
            bf16 = yield
        penalties = {}
        for recipe in s.candidates(step):
            with s.trying(step, recipe):
                penalties[recipe] = penalty((yield), bf16)
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
    def validation(self, step: int) -> Iterator[None]:
        """The validation after step ``step`` (a generator of the losses it needs, returning ``valid_loss`` and
        in an FP8 phase ``valid_loss_bf16`` and ``fp8_penalty``), and what FP8's penalty asks for from the next
        step on."""
        s = self.schedule
        out = {"valid_loss": (yield)}
        if s.in_fp8():
            with s.forced_bf16():
                out["valid_loss_bf16"] = yield
            out["fp8_penalty"] = penalty(out["valid_loss"], out["valid_loss_bf16"])
        s.commit_amax()
        self._watch_penalty(step, out)
        return out

    def _watch_penalty(self, step: int, metrics: dict) -> None:
        """FP8's penalty too high for ``penalty_patience`` validations: warn, fall back along the chain, or BF16."""
        if "fp8_penalty" not in metrics or not self.penalty.observe(metrics["fp8_penalty"]):
            return
        guard, following = self.cfg.guard, step + 1
        now = self.schedule.phase_at(following).label
        action = guard.penalty_action
        reason = (f"FP8 penalty {100 * metrics['fp8_penalty']:+.2f}% above max_penalty {100 * guard.max_penalty:.3g}%"
                  f" for {guard.penalty_patience} validation{'s' if guard.penalty_patience > 1 else ''} in a row")
        if action == "warn":
            self.event(step, "fp8_penalty", reason=reason, recipe=now)
        else:
            target = "bf16" if action == "bf16" else self.schedule.next_fallback(following)
            self.schedule.switch_recipe(following, target, reason)
            self.event(step, "precision_fallback", reason=reason, to=target, **{"from": now})
        self.say(f"[llmjp-ds] step {step}: {reason}" + ("" if action == "warn" else f"; from {now} to {target}"))

    # --- on divergence ----------------------------------------------------------------------------------
    def after_step(self, step: int, lm_loss: float, z_loss: float, phase: dict) -> tuple[str, int] | None:
        """The guard's verdict on ``step``'s loss: why to roll back (a non-finite loss, a loss spike) and the first
        bad step of the divergence (the rollback goes to a checkpoint at or before it), or None."""
        if not self.guard.observe(step, lm_loss + z_loss, phase["precision"]):
            return None
        first_bad = self.guard.first_bad_step if self.guard.first_bad_step is not None else step
        return ("non-finite loss" if not math.isfinite(lm_loss) else "loss spike"), first_bad

    def rolled_back(self, failed_step: int, good_step: int, good_tag: str, reason: str, client: dict) -> None:
        """The weights of checkpoint ``good_tag`` (after step ``good_step``; its trainer state ``client``) are
        loaded: the guard resumes from them, and from the step after it on every FP8 phase runs in BF16."""
        s = self.schedule
        rollbacks = s.rollbacks + 1
        s.weights_changed()
        self.guard.load_state_dict(client.get("guard", {}))
        s.fallback_from_step, s.rollbacks = good_step + 1, rollbacks
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
