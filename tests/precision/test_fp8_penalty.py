"""FP8's loss penalty measured online (emulated FP8 on CPU): every validation in an FP8 phase also evaluates the
same weights on the same batches with FP8 off; the penalty guard's actions (warn, the fallback chain, BF16);
``recipe: auto`` choosing at the flip by measured penalty; and resumes in the middle of each."""

from __future__ import annotations

import math

import pytest
import torch

from .test_flip_training import FLIP_AT, trail, train

EVERY_STEP = ("train.eval_interval=1", "train.eval_batches=1")


def _phases(recipe: str, fallback: str = "[]") -> str:
    return (f"precision.phases=[{{precision: bf16}}, {{precision: fp8, start_step: {FLIP_AT}, recipe: {recipe}, "
            f"amax_history_len: 4, calibration_steps: 1, fallback: {fallback}}}]")


# --- the BF16 reference leaves the FP8 state alone --------------------------------------------------------------

def _model_and_schedule():
    from llmjp_ds.config import load_config
    from llmjp_ds.model import LlamaForCausalLM, model_config
    from llmjp_ds.precision.schedule import PrecisionSchedule

    cfg = load_config(None, ["precision.emulate_fp8=true", _phases("delayed")], "demo")
    schedule = PrecisionSchedule(cfg.precision, "torch", 64)
    torch.manual_seed(0)
    config = model_config("tiny", hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          ffn_hidden_size=128, vocab_size=256)
    model = LlamaForCausalLM(config, backend="torch").eval()
    schedule.attach(model, model.model.layers, config.num_hidden_layers)
    return model, schedule


def _fp8_state(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items() if k.endswith("_extra_state") and v.numel()}


@pytest.mark.parametrize("with_reference", [False, True])
def test_the_bf16_reference_pass_leaves_amax_histories_and_scales_unchanged(with_reference):
    """Calibrate, then two FP8 validations as the trainer runs them; with or without the BF16 pass between the
    FP8 forward and the commit, the amax histories (which the scales are computed from) must be identical."""
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(3))
    results = {}
    for reference in (False, with_reference):
        model, schedule = _model_and_schedule()
        losses = []
        for step in (FLIP_AT - 1, FLIP_AT, FLIP_AT + 1):  # a calibration step, then FP8
            schedule.begin_step(step)
            with torch.no_grad(), schedule.micro_batch():
                losses.append(model.training_loss(ids[:, :-1], ids[:, 1:]).lm_loss.item())
            if reference:
                with torch.no_grad(), schedule.forced_bf16(), schedule.micro_batch():
                    losses.append(model.training_loss(ids[:, :-1], ids[:, 1:]).lm_loss.item())
            schedule.commit_amax()
        results[reference] = (_fp8_state(model), losses)
    plain, other = results[False], results[with_reference]
    assert plain[0].keys() == other[0].keys() and plain[0]
    for name in plain[0]:
        assert torch.equal(plain[0][name], other[0][name]), name
    if with_reference:
        fp8, bf16 = other[1][2], other[1][3]  # step FLIP_AT: the FP8 loss and its BF16 reference
        assert fp8 != bf16 and other[1][3] == other[1][1]  # weights unchanged: BF16 is BF16 at every step


# --- in training runs ----------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(600)
def test_penalty_fields_in_fp8_phases(env, tmp_path):
    run = tmp_path / "run"
    train(env, run, "train.steps=5", *EVERY_STEP)
    records, _ = trail(run)
    for step, r in records.items():
        if r["precision"] == "fp8":
            assert r["fp8_penalty"] == r["valid_loss"] / r["valid_loss_bf16"] - 1 and r["fp8_penalty"] != 0.0
        else:
            assert "fp8_penalty" not in r and "valid_loss_bf16" not in r
    assert [s for s, r in records.items() if "fp8_penalty" in r] == list(range(FLIP_AT, 6))


GUARD = ("precision.guard.max_penalty=0.02", "precision.guard.penalty_patience=2",
         "precision.guard.penalty_action=fallback")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_injected_penalty_steps_down_the_fallback_chain_and_a_resume_repeats_it(env, tmp_path):
    """A 5 % penalty (the drill) against max_penalty 2 %, patience 2: current -> block after two FP8
    validations, block -> BF16 after two more; a run stopped between the two switches and resumed logs the
    same trail and the same events."""
    drill = dict(env, LLMJP_DS_DRILL_FP8_PENALTY="0.05")
    sets = (_phases("current", "[block, bf16]"), *EVERY_STEP, *GUARD)
    full = tmp_path / "full"
    train(drill, full, "train.steps=9", *sets)
    records, events = trail(full)
    falls = [(e["step"], e["from"], e["to"]) for e in events if e["event"] == "precision_fallback"]
    # each after the second validation of a recipe (after its second step), from the next step on
    assert falls == [(FLIP_AT + 1, "fp8-current-hybrid", "block"), (FLIP_AT + 3, "fp8-block-hybrid", "bf16")]
    labels = [records[s]["phase"] for s in sorted(records)]
    assert labels == ["fp32"] * (FLIP_AT - 1) + ["fp8-current-hybrid"] * 2 + ["fp8-block-hybrid"] * 2 + ["fp32"] * 2
    measured = [r["fp8_penalty"] for r in records.values() if "fp8_penalty" in r]
    assert len(measured) == 4 and all(math.isclose(p, 0.05, rel_tol=0.2) for p in measured), measured
    resumed = tmp_path / "resumed"
    train(drill, resumed, "train.steps=6", *sets)
    train(drill, resumed, "train.steps=9", *sets)
    again, again_events = trail(resumed)
    assert [again[s]["loss"] for s in sorted(again)] == [records[s]["loss"] for s in sorted(records)]
    assert [again[s]["phase"] for s in sorted(again)] == labels
    assert [(e["step"], e["from"], e["to"]) for e in again_events if e["event"] == "precision_fallback"] == falls


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_recipe_auto_flips_to_the_lowest_penalty_and_a_resume_keeps_the_choice(env, tmp_path):
    sets = (_phases("auto"), *EVERY_STEP)
    full = tmp_path / "full"
    proc = train(env, full, "train.steps=6", *sets)
    records, events = trail(full)
    (choice,) = [e for e in events if e["event"] == "recipe_choice"]
    penalties = {r: choice[f"penalty_{r}"] for r in ("delayed", "current", "block")}
    assert choice["step"] == FLIP_AT and choice["chosen"] == min(penalties, key=penalties.get)
    assert f"recipe auto at step {FLIP_AT}: {choice['chosen']}" in proc.stdout
    assert records[FLIP_AT]["phase"] == f"fp8-{choice['chosen']}-hybrid"
    resumed = tmp_path / "resumed"
    train(env, resumed, f"train.steps={FLIP_AT}", *sets)
    train(env, resumed, "train.steps=6", *sets)
    again, again_events = trail(resumed)
    assert [again[s]["loss"] for s in sorted(again)] == [records[s]["loss"] for s in sorted(records)]
    assert [e["chosen"] for e in again_events if e["event"] == "recipe_choice"] == [choice["chosen"]]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_recipe_auto_stays_in_bf16_when_no_candidate_is_within_max_penalty(env, tmp_path):
    run = tmp_path / "run"
    proc = train(env, run, "train.steps=5", _phases("auto"), *EVERY_STEP, "precision.guard.max_penalty=1e-9")
    records, events = trail(run)
    (choice,) = [e for e in events if e["event"] == "recipe_choice"]
    assert choice["chosen"] == "bf16" and choice["reason"].startswith("no candidate within max_penalty")
    assert f"recipe auto at step {FLIP_AT}: bf16 (no candidate within max_penalty" in proc.stdout
    assert all(r["precision"] == "fp32" for r in records.values())
