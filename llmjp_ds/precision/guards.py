"""What watches FP8 once it runs; what is done about it is :mod:`llmjp_ds.precision.controller`'s.

* :class:`DivergenceGuard`: after a flip, a non-finite loss or a loss spike asks for a rollback to the last good
  checkpoint, to continue in BF16.
* :class:`PenaltyMonitor`: FP8's loss penalty, ``valid_loss / valid_loss_bf16 - 1``, measured at every validation
  of an FP8 phase on the same weights and batches with FP8 off. Above ``max_penalty`` for ``penalty_patience``
  validations in a row it asks for the configured action: warn, step down the phase's fallback chain of
  recipes, or go back to BF16.
* :func:`choose_recipe`: ``recipe: auto`` evaluates each candidate recipe on the validation batches just before
  the flip and flips to the one with the lowest penalty within ``max_penalty``, or stays in BF16.
"""

from __future__ import annotations

import math
from collections import deque


def penalty(fp8_loss: float, bf16_loss: float) -> float:
    """FP8's relative loss penalty over BF16 on the same weights and batches."""
    return fp8_loss / bf16_loss - 1.0


def choose_recipe(penalties: dict[str, float], max_penalty: float) -> tuple[str, str]:
    """(the recipe to flip to, why): the candidate with the lowest penalty if it is within ``max_penalty``,
    else ``bf16``. Ties go to the candidate listed first."""
    best = min(penalties, key=lambda r: (penalties[r], list(penalties).index(r)))
    measured = ", ".join(f"{r} {100 * p:+.3f}%" for r, p in penalties.items())
    if penalties[best] <= max_penalty:
        return best, f"lowest penalty ({measured}) within max_penalty {100 * max_penalty:.3g}%"
    return "bf16", f"no candidate within max_penalty {100 * max_penalty:.3g}% ({measured})"


class PenaltyMonitor:
    """Counts consecutive validations whose FP8 penalty is above ``max_penalty``."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.above = 0

    def observe(self, value: float) -> bool:
        """Record one validation's penalty; True when it has been too high for ``penalty_patience`` in a row
        (the count restarts after an action)."""
        self.above = self.above + 1 if not value <= self.cfg.max_penalty else 0
        if self.above >= self.cfg.penalty_patience:
            self.above = 0
            return True
        return False

    def state_dict(self) -> dict:
        return {"above": self.above}

    def load_state_dict(self, state: dict) -> None:
        self.above = state.get("above", 0)


class DivergenceGuard:
    """After a flip to FP8: a non-finite loss, or a loss above ``factor`` x the running mean of the last
    ``window`` pre-flip losses for ``patience`` consecutive steps, asks for a rollback."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.history: deque = deque(maxlen=cfg.window)
        self.bad_steps = 0
        self.first_bad_step: int | None = None

    def observe(self, step: int, loss: float, precision: str) -> bool:
        """Record ``loss`` of ``step``; True when the run should roll back."""
        if not self.cfg.enabled:
            return False
        if precision != "fp8":
            if math.isfinite(loss):
                self.history.append(loss)
            self.bad_steps, self.first_bad_step = 0, None
            return False
        mean = sum(self.history) / len(self.history) if self.history else None
        bad = not math.isfinite(loss) or (mean is not None and loss > self.cfg.factor * mean)
        if not bad:
            self.bad_steps, self.first_bad_step = 0, None
            return False
        if self.first_bad_step is None:
            self.first_bad_step = step
        self.bad_steps += 1
        return not math.isfinite(loss) or self.bad_steps >= self.cfg.patience

    def state_dict(self) -> dict:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.history.clear()
        self.history.extend(state.get("history", []))
        self.bad_steps, self.first_bad_step = 0, None
