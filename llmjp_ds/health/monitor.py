"""Training health: loss spikes, grad-norm spikes, non-finite steps and validation jumps, each detected from what
the trainer already has and answered by the action the config names for its kind (``health.*``).

* Detection: a value is a spike when it lies ``threshold`` robust standard deviations above the median of its own
  recent history (``1.4826 x`` the median absolute deviation over ``health.window`` values) and ``min_ratio`` times
  above the median itself (a flat history has a tiny deviation); no verdict before ``health.min_history`` values,
  so the warm-up's falling loss is history, not a spike. A spike does not enter the history.
* Actions: ``warn`` (an event); ``skip`` (the step's update is not made: the loss is known before the last
  micro-batch's backward, :meth:`HealthMonitor.gate`; the samples count as consumed, the LR schedule does not
  advance); ``rollback`` (back to the newest intact checkpoint before the spike, skipping a window of samples:
  :func:`skip_window`); ``stop`` (one line). More than ``health.max_rollbacks`` rollbacks within
  ``health.rollback_window`` steps stop the run instead.
* A rollback's window is a range of steps whose samples are read and not trained on (Megatron-LM's
  ``--iterations-to-skip``; ``train.skip_steps`` says the same in the config), kept in the run's state and in every
  later checkpoint's marker, for every later resume, reshape resume, branch and ``llmjp-ds samples --run``.

Pure: the trainer hands values in and acts on the :class:`Verdict` that comes back.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field

MAD_TO_SIGMA = 1.4826  # a normal distribution's standard deviation per median absolute deviation


@dataclass
class Verdict:
    """What the monitor found at ``step`` and what the config says to do about it (``where``: which expert, for
    a router's collapse)."""

    kind: str
    action: str
    step: int
    value: float
    median: float | None = None
    sigma: float | None = None  # the robust standard deviation of the history
    z: float | None = None
    where: str | None = None

    def fields(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "step" and v is not None}

    def describe(self) -> str:
        if self.kind == "nonfinite":
            return f"a non-finite loss or gradient at step {self.step}"
        if self.kind == "router":
            return f"a router collapse at step {self.step}: {self.where} got no token for {self.value:.0f} steps"
        return (f"a {self.kind.replace('_', ' ')} spike at step {self.step}: {self.value:.4g} against a median of "
                f"{self.median:.4g} (z {self.z:.1f})")


def spike(history, value: float, rule, min_history: int) -> Verdict | None:
    """The verdict on ``value`` against ``history`` under ``rule`` (``SpikeRule``), or None (step filled in by the
    caller)."""
    values = list(history)
    if len(values) < min_history or not math.isfinite(value):
        return None
    median = statistics.median(values)
    sigma = MAD_TO_SIGMA * statistics.median(abs(v - median) for v in values)
    z = (value - median) / sigma if sigma > 0 else math.inf
    if z > rule.threshold and value > rule.min_ratio * median:
        return Verdict("", rule.action, 0, value, median, sigma, z)
    return None


@dataclass
class HealthState:
    """What the monitor remembers: each kind's recent values, the steps of recent rollbacks, and how many steps in
    a row each starved expert (``"layer:expert"``) has had no token."""

    history: dict = field(default_factory=dict)
    rollbacks: list = field(default_factory=list)
    starved: dict = field(default_factory=dict)


class HealthMonitor:
    """Detection and the configured action, per kind, for the trainer's loop (``cfg``: the run's ``health``)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.history = {k: deque(maxlen=cfg.window) for k in ("loss", "grad_norm", "valid_loss")}
        self.rollbacks: list[int] = []
        self.starved: dict[str, int] = {}

    def _judge(self, kind: str, step: int, value: float, record: bool = True) -> Verdict | None:
        rule = getattr(self.cfg, kind)
        found = spike(self.history[kind], value, rule, self.cfg.min_history if kind != "valid_loss" else 3)
        if found is None:
            if record and math.isfinite(value):
                self.history[kind].append(value)
            return None
        found.kind, found.step = kind, step
        return found

    def gate(self, step: int, loss: float) -> bool:
        """Before the last micro-batch's backward, with the step's mean loss over every rank: True when the update
        is to be skipped (a loss spike; :meth:`gate_at` hands the gate out under ``health.loss.action: skip``)."""
        return self._judge("loss", step, loss, record=False) is not None

    def gate_at(self, step: int):
        """:meth:`gate` at ``step`` for the step runner, or None when no action asks before the update (a runner
        given none neither reduces the loss nor waits for it)."""
        return functools.partial(self.gate, step) if self.cfg.loss.action == "skip" else None

    def after_step(self, step: int, loss: float, grad_norm: float | None, applied: bool,
                   gated: bool = False) -> Verdict | None:
        """The verdict on step ``step`` (its loss, its gradient norm, whether the update was made, whether the gate
        skipped it), or None."""
        if gated:  # a rank whose stage ran no gate (a pipeline's first stages) learns it here
            return self._judge("loss", step, loss, record=False) or Verdict("loss", "skip", step, loss)
        if not applied or not math.isfinite(loss):
            return Verdict("nonfinite", self.cfg.nonfinite, step, loss)
        found = self._judge("loss", step, loss)
        if grad_norm is not None and math.isfinite(grad_norm):
            norm = self._judge("grad_norm", step, grad_norm)
            found = found or norm
        return found

    def after_validation(self, step: int, valid_loss: float) -> Verdict | None:
        return self._judge("valid_loss", step, valid_loss)

    def after_routing(self, step: int, starved: list[tuple[int, int]]) -> Verdict | None:
        """The verdict on an MoE model's routers after step ``step``, given the ``(MoE layer, expert)`` of every
        expert that got no token in it: a collapse once one has had none for ``health.router.starved_steps`` steps
        in a row."""
        self.starved = {f"{layer}:{expert}": self.starved.get(f"{layer}:{expert}", 0) + 1 for layer, expert in starved}
        if not self.starved:
            return None
        key, count = max(self.starved.items(), key=lambda kv: kv[1])
        if count < self.cfg.router.starved_steps:
            return None
        layer, expert = key.split(":")
        self.starved[key] = 0  # the next verdict on it after as many steps more
        return Verdict("router", self.cfg.router.action, step, float(count), where=f"expert {expert} of MoE layer "
                       f"{layer}")

    def rollback_allowed(self, step: int) -> bool:
        """Whether one more rollback at ``step`` stays within ``max_rollbacks`` in ``rollback_window`` steps (and
        records it when it does)."""
        recent = [s for s in self.rollbacks if s > step - self.cfg.rollback_window]
        if len(recent) >= self.cfg.max_rollbacks:
            return False
        self.rollbacks = recent + [step]
        return True

    def state_dict(self) -> dict:
        return asdict(HealthState({k: list(v) for k, v in self.history.items()}, list(self.rollbacks),
                                  dict(self.starved)))

    def load_state_dict(self, state: dict, keep_rollbacks: bool = False) -> None:
        """The histories of a checkpoint (``keep_rollbacks``: after a rollback, the count of rollbacks goes on)."""
        for kind, values in state.get("history", {}).items():
            if kind in self.history:
                self.history[kind].clear()
                self.history[kind].extend(values)
        if not keep_rollbacks:
            self.rollbacks = list(state.get("rollbacks", []))
        self.starved = dict(state.get("starved", {}))
