"""The precision schedule, in one process (no DeepSpeed): phases by step and by tokens, calibration, fallback,
the checks of bad phases, attaching FP8 state to the model (layers kept in BF16, the LM head)."""

from __future__ import annotations

import pytest
import torch

from llmjp_ds.config import PhaseConfig, PrecisionConfig
from llmjp_ds.errors import UserError
from llmjp_ds.precision.schedule import PrecisionSchedule
from tests.precision.helpers import schedule, tiny_model


def test_flip_by_step_and_by_tokens_land_on_the_same_step():
    by_step = schedule([{}, {"precision": "fp8", "start_step": 7}])
    # the first step that starts after 6000 tokens of 1000 a step: the 7th
    by_tokens = schedule([{}, {"precision": "fp8", "start_tokens": 6000}], tokens_per_step=1000)
    for s in (by_step, by_tokens):
        assert [s.phase_at(i).precision for i in (0, 6, 7, 100)] == ["bf16", "bf16", "fp8", "fp8"]
        assert s.is_flip_step(7) and not s.is_flip_step(6) and not s.is_flip_step(8)
    assert by_step.describe(7) == {"precision": "fp8", "phase": 1, "recipe": "fp8-delayed-hybrid",
                                   "emulated": True, "calibrating": False}
    assert by_step.describe(1)["precision"] == "fp32"  # the base dtype, not "bf16", outside FP8


def test_delayed_scaling_calibrates_only_the_steps_before_the_flip():
    s = schedule([{}, {"precision": "fp8", "start_step": 5, "calibration_steps": 2}])
    assert [s.calibrating(i) is not None for i in range(7)] == [False, False, False, True, True, False, False]
    current = schedule([{}, {"precision": "fp8", "start_step": 5, "recipe": "current"}])
    assert all(current.calibrating(i) is None for i in range(7))  # stateless recipes need no calibration


def test_fallback_turns_fp8_phases_into_the_base_precision():
    s = schedule([{}, {"precision": "fp8", "start_step": 3}])
    s.fallback_from_step = 4
    assert [s.phase_at(i).precision for i in range(6)] == ["bf16", "bf16", "bf16", "fp8", "bf16", "bf16"]
    s.load_state_dict(s.state_dict())
    assert s.fallback_from_step == 4


@pytest.mark.parametrize("phases, message", [
    ([{"start_step": 2}], "must start at step 1"),
    ([{}, {"precision": "fp16", "start_step": 2}], "must be bf16 or fp8"),
    ([{}, {"precision": "fp8", "start_step": 2, "recipe": "mxfp8"}], "recipe must be one of"),
    ([{}, {"precision": "fp8", "start_step": 5}, {"start_step": 3}], "must be after the previous"),
])
def test_bad_phases_are_one_line_errors(phases, message):
    with pytest.raises(UserError, match=message):
        schedule(phases)


def test_real_fp8_without_te_is_refused_unless_emulation_is_asked_for():
    cfg = PrecisionConfig(phases=[PhaseConfig(), PhaseConfig(precision="fp8", start_step=3)])
    with pytest.raises(UserError, match="emulate_fp8=true"):
        PrecisionSchedule(cfg, backend="torch", tokens_per_step=1)


def test_bf16_layer_policy_keeps_chosen_layers_out_of_fp8():
    s = schedule([{}, {"precision": "fp8", "start_step": 2, "recipe": "current"}], bf16_first_layers=1)
    model = tiny_model(s)
    ids = torch.randint(0, 256, (2, 17))
    with s.autocast(2):
        model.training_loss(ids[:, :-1], ids[:, 1:]).loss.backward()
    s.end_step()
    assert getattr(model.model.layers[0].layernorm_mlp, "_fp8_emu_state", None) is None
    assert model.model.layers[1].layernorm_mlp._fp8_emu_state is not None


@pytest.mark.parametrize("fp8_head", [False, True])
def test_the_lm_head_is_fp8_only_when_asked(fp8_head):
    """By default FP8 phases keep the head in BF16 (as LLM-jp did); ``precision.fp8_lm_head`` quantises it like a
    decoder layer's GEMM, with its own scaling state in ``lm_head._extra_state``."""
    s = schedule([{"precision": "fp8", "recipe": "current"}], fp8_lm_head=fp8_head)
    model = tiny_model(s, fp8_lm_head=fp8_head)
    x = torch.randn(2, 9, 64)
    plain = model.lm_head(x)
    with s.autocast(0):
        quantised = model.lm_head(x)
        other = model.model.layers[0].self_attention.proj(x)  # a decoder GEMM is FP8 either way
    assert not torch.equal(other, model.model.layers[0].self_attention.proj(x))
    assert torch.equal(quantised, plain) is not fp8_head
    rel = ((quantised - plain).norm() / plain.norm()).item()
    assert rel < 0.1  # e4m3 inputs and weights: close to the BF16 head
    assert ("lm_head._extra_state" in model.state_dict()) is fp8_head
    assert [k for k in model.state_dict() if "lm_head" in k and not k.endswith("_extra_state")] == ["lm_head.weight"]


def test_the_fp8_capable_head_starts_from_the_same_weights():
    """Switching ``precision.fp8_lm_head`` changes the head's module, not the run's initial model."""
    from llmjp_ds.parallel.build import init_like_pipeline
    from llmjp_ds.model import LlamaForCausalLM, model_config

    config = model_config("tiny", hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          ffn_hidden_size=128, vocab_size=256)
    states = []
    for fp8_head in (False, True):
        model = LlamaForCausalLM(config, backend="torch", fp8_lm_head=fp8_head)
        init_like_pipeline(model, config, "torch", seed=7, fp8_head=fp8_head)
        states.append({k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")})
    assert states[0].keys() == states[1].keys()
    for name in states[0]:
        assert torch.equal(states[0][name], states[1][name]), name
    assert states[0]["lm_head.weight"].std() > 0
