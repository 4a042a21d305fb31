"""The precision controller's decisions, in one process with stand-in validation losses (no DeepSpeed, no
model): ``recipe: auto`` at the flip, the penalty's warn / fallback / bf16 actions, the rollback after a
divergence, and the state a checkpoint carries."""

from __future__ import annotations

import pytest

from llmjp_ds.config import GuardConfig, PhaseConfig, PrecisionConfig
from llmjp_ds.errors import UserError
from llmjp_ds.precision.controller import PrecisionController
from llmjp_ds.precision.recipes import validate_phases
from llmjp_ds.precision.schedule import PrecisionSchedule
from llmjp_ds.trainer.heldout_loss import measured


class Recorder:
    def __init__(self):
        self.events, self.lines = [], []

    def event(self, step, kind, **fields):
        self.events.append((step, kind, fields))

    def say(self, line):
        self.lines.append(line)

    def kinds(self):
        return [kind for _, kind, _ in self.events]


def controller(phases, **guard):
    cfg = PrecisionConfig(dtype="fp32", phases=[PhaseConfig(**p) for p in phases], emulate_fp8=True,
                          guard=GuardConfig(**guard))
    validate_phases(cfg, num_layers=4)
    rec = Recorder()
    return PrecisionController(PrecisionSchedule(cfg, "torch", 1000), cfg, rec.event, rec.say), rec


def losses_by_recipe(ctl, table):
    """A ``measure`` whose loss depends on what the schedule runs now: ``table[recipe]`` or ``table["bf16"]``."""
    s = ctl.schedule

    def measure():
        return table["bf16"] if not s.in_fp8() else table[s.phase_at(s.step).recipe]

    return measure


def test_recipe_auto_flips_to_the_candidate_with_the_lowest_penalty():
    ctl, rec = controller([{}, {"precision": "fp8", "start_step": 2, "recipe": "auto",
                                "candidates": ["delayed", "current"]}])
    measure = losses_by_recipe(ctl, {"bf16": 1.0, "delayed": 1.05, "current": 1.01})
    assert not ctl.choice_due(1)  # no choice due before the flip: the loop opens no validation
    assert ctl.before_step(1)["precision"] == "fp32"
    assert ctl.choice_due(2)
    measured(ctl.choose_recipe(2), measure)
    phase = ctl.before_step(2)
    assert phase["recipe"] == "fp8-current-hybrid"
    assert rec.kinds() == ["recipe_choice", "precision_flip"]
    step, _, choice = rec.events[0]
    assert step == 2 and choice["chosen"] == "current" and choice["penalty_delayed"] == pytest.approx(0.05)
    assert rec.lines == [f"[llmjp-ds] recipe auto at step 2: current ({choice['reason']})"]


def test_recipe_auto_stays_in_bf16_when_no_candidate_is_within_max_penalty():
    ctl, rec = controller([{}, {"precision": "fp8", "start_step": 2, "recipe": "auto",
                                "candidates": ["delayed", "current"]}])
    measure = losses_by_recipe(ctl, {"bf16": 1.0, "delayed": 1.5, "current": 1.4})
    measured(ctl.choose_recipe(2), measure)
    assert ctl.before_step(2)["precision"] == "fp32"
    assert rec.events[0][2]["chosen"] == "bf16"


@pytest.mark.parametrize("action,after", [("warn", "fp8-delayed-hybrid"), ("fallback", "fp8-current-hybrid"),
                                          ("bf16", "bf16")])
def test_a_penalty_too_high_for_patience_validations_takes_the_configured_action(action, after):
    ctl, rec = controller([{"precision": "fp8", "recipe": "delayed", "fallback": ["current"]}],
                          max_penalty=0.02, penalty_patience=2, penalty_action=action)
    measure = losses_by_recipe(ctl, {"bf16": 1.0, "delayed": 1.1, "current": 1.0})
    ctl.schedule.begin_step(5)
    first = measured(ctl.validation(5), measure)
    assert first == {"valid_loss": 1.1, "valid_loss_bf16": 1.0, "fp8_penalty": pytest.approx(0.1)}
    assert rec.events == []  # once is not yet penalty_patience
    measured(ctl.validation(6), measure)
    kind = {"warn": "fp8_penalty"}.get(action, "precision_fallback")
    assert rec.kinds() == [kind] and rec.events[0][0] == 6
    assert ctl.schedule.phase_at(7).label == after
    assert len(rec.lines) == 1 and rec.lines[0].startswith("[llmjp-ds] step 6: FP8 penalty +10.00%")


def test_bf16_validations_measure_once_and_watch_nothing():
    ctl, rec = controller([{}], penalty_action="bf16")
    calls = []
    out = measured(ctl.validation(3), lambda: calls.append(1) or 2.0)
    assert out == {"valid_loss": 2.0} and len(calls) == 1 and rec.events == []


def test_a_divergence_rolls_back_to_the_newest_checkpoint_before_its_first_bad_step_and_goes_on_in_bf16():
    ctl, rec = controller([{}, {"precision": "fp8", "start_step": 3}], window=2, factor=1.5, patience=2)
    bf16, fp8 = ctl.schedule.describe(1), ctl.schedule.describe(3)
    for step in (1, 2):
        assert ctl.after_step(step, 2.0, 0.0, bf16) is None
    assert ctl.after_step(3, 2.1, 0.0, fp8) is None
    assert ctl.after_step(4, 9.0, 0.0, fp8) is None  # a spike: patience 2
    # the first bad step is 4: the loop rolls back to the newest checkpoint saved before it ran (tag 3 holds steps
    # 1..3; trainer/restore.py)
    assert ctl.after_step(5, 9.0, 0.0, fp8) == ("loss spike", 4)
    good_step, good_tag = 3, "step00000003"
    ctl.rolled_back(5, good_step, good_tag, "loss spike", {"guard": {"history": [2.0, 2.0]}})
    # from step 4 on every FP8 phase runs in BF16
    assert ctl.rollbacks == 1 and ctl.schedule.phase_at(4).precision == "bf16"
    assert ctl.schedule.phase_at(3).precision == "fp8"  # what ran before the rollback point stays as it was
    assert rec.kinds() == ["rollback"] and rec.events[0][2]["to_step"] == 3
    assert ctl.after_step(4, float("nan"), 0.0, ctl.schedule.describe(4)) is None  # BF16 now: no guard


def test_a_non_finite_fp8_loss_rolls_back_at_once_and_needs_a_checkpoint_before_it(tmp_path):
    from llmjp_ds import checkpoint
    from llmjp_ds.trainer.restore import Resume

    ctl, _ = controller([{"precision": "fp8"}])
    fp8 = ctl.schedule.describe(1)
    assert ctl.after_step(1, float("nan"), 0.0, fp8) == ("non-finite loss", 1)
    tag = checkpoint.checkpoint_dir(tmp_path) / "step00000001"  # a checkpoint after the first bad step only
    tag.mkdir(parents=True)
    (tag / checkpoint.MARKER).write_text("{}")

    class Watchdog:
        def beat(self, *phase):
            pass

    resume = Resume(tmp_path, None, 2, None, None, ctl.schedule, Watchdog())
    with pytest.raises(UserError, match="non-finite loss at step 1, and there is no checkpoint before it to roll"):
        resume.rollback(1, "non-finite loss")


def test_the_state_a_checkpoint_carries_comes_back():
    ctl, _ = controller([{"precision": "fp8", "recipe": "delayed", "fallback": ["current"]}],
                        penalty_action="fallback", penalty_patience=1)
    ctl.schedule.begin_step(2)
    measured(ctl.validation(2), losses_by_recipe(ctl, {"bf16": 1.0, "delayed": 1.1, "current": 1.0}))
    ctl.rolled_back(3, 2, "step00000002", "loss spike", {})
    state = ctl.state_dict()
    assert sorted(state) == ["guard", "penalty", "precision"]
    again, _ = controller([{"precision": "fp8", "recipe": "delayed", "fallback": ["current"]}])
    again.load_state_dict(state)
    assert again.state_dict() == state and again.rollbacks == 1
    assert [again.schedule.phase_at(s).label for s in (2, 3)] == ["fp8-delayed-hybrid", "bf16"]
