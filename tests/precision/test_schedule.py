"""The precision schedule and the FP8 emulation, in one process (no DeepSpeed)."""

from __future__ import annotations

import pytest
import torch

from llmjp_ds.config import GuardConfig, PhaseConfig, PrecisionConfig
from llmjp_ds.errors import UserError
from llmjp_ds.precision.guards import DivergenceGuard
from llmjp_ds.precision.recipes import validate_phases
from llmjp_ds.precision.schedule import PrecisionSchedule


def schedule(phases, tokens_per_step=1000, **kw):
    cfg = PrecisionConfig(dtype="fp32", phases=[PhaseConfig(**p) for p in phases], emulate_fp8=True, **kw)
    validate_phases(cfg, num_layers=4)
    return PrecisionSchedule(cfg, backend="torch", tokens_per_step=tokens_per_step)


def test_flip_by_step_and_by_tokens_land_on_the_same_step():
    by_step = schedule([{}, {"precision": "fp8", "start_step": 7}])
    by_tokens = schedule([{}, {"precision": "fp8", "start_tokens": 6001}], tokens_per_step=1000)
    for s in (by_step, by_tokens):
        assert [s.phase_at(i).precision for i in (0, 6, 7, 100)] == ["bf16", "bf16", "fp8", "fp8"]
        assert s.is_flip_step(7) and not s.is_flip_step(6) and not s.is_flip_step(8)
    assert by_step.describe(7) == {"precision": "fp8", "phase": 1, "recipe": "fp8-delayed-hybrid",
                                   "emulated": True, "calibrating": False}
    assert by_step.describe(0)["precision"] == "fp32"  # the base dtype, not "bf16", outside FP8


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
    ([{"start_step": 2}], "must start at step 0"),
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


def test_guard_rolls_back_on_nan_at_once_and_on_spikes_after_patience():
    guard = DivergenceGuard(GuardConfig(window=4, factor=1.5, patience=2))
    for i, loss in enumerate([3.0, 3.0, 3.0, 3.0]):
        assert not guard.observe(i, loss, "bf16")
    assert not guard.observe(4, 3.2, "fp8")
    assert not guard.observe(5, 5.0, "fp8")  # first spike: wait for patience
    assert guard.observe(6, 5.0, "fp8") and guard.first_bad_step == 5
    guard.load_state_dict(guard.state_dict())
    assert guard.observe(7, float("nan"), "fp8")
    assert not DivergenceGuard(GuardConfig(enabled=False)).observe(0, float("nan"), "fp8")


def _tiny_model(schedule=None, **kw):
    """The tiny torch-backend model; with ``schedule``, attached to it as the trainer attaches it."""
    from llmjp_ds.model import LlamaForCausalLM, model_config

    torch.manual_seed(0)
    config = model_config("tiny", hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          ffn_hidden_size=128, vocab_size=256)
    model = LlamaForCausalLM(config, backend="torch", **kw)
    if schedule is not None:
        schedule.attach(model, model.model.layers, config.num_hidden_layers)
        model.checkpoint_fn = schedule.checkpoint_function(model.checkpoint_fn)
    return model


@pytest.mark.parametrize("recipe", ["delayed", "current", "block"])
def test_emulated_fp8_quantises_forward_and_backward(recipe):
    s = schedule([{}, {"precision": "fp8", "start_step": 2, "recipe": recipe, "calibration_steps": 1}])
    model = _tiny_model(s)
    ids = torch.randint(0, 256, (2, 33))
    ref = model.training_loss(ids[:, :-1], ids[:, 1:]).loss
    ref.backward()
    ref_grad = model.model.layers[0].layernorm_mlp.fc1_weight.grad.clone()
    model.zero_grad()
    for step in (1, 2):  # step 1 calibrates (delayed), step 2 runs in FP8
        with s.autocast(step):
            loss = model.training_loss(ids[:, :-1], ids[:, 1:]).loss
        if step == 1 and recipe == "delayed":
            torch.testing.assert_close(loss, ref)  # calibration computes in full precision
        model.zero_grad()
        loss.backward()
        s.end_step()
    grad = model.model.layers[0].layernorm_mlp.fc1_weight.grad
    rel_loss = abs(loss.item() - ref.item()) / ref.item()
    rel_grad = ((grad - ref_grad).norm() / ref_grad.norm()).item()
    # FP8 changes the numbers (e4m3 has a 3-bit mantissa), but only slightly
    assert 0 < rel_loss < 0.02, rel_loss
    assert 0 < rel_grad < 0.25, rel_grad


def test_emulated_amax_history_travels_in_extra_state():
    s = schedule([{}, {"precision": "fp8", "start_step": 1, "amax_history_len": 4}])
    model = _tiny_model(s)
    ids = torch.randint(0, 256, (2, 17))
    with s.autocast(1):
        model.training_loss(ids[:, :-1], ids[:, 1:]).loss.backward()
    s.end_step()
    state = model.state_dict()
    history = state["model.layers.0.layernorm_mlp._extra_state"]
    assert history.dtype == torch.float32 and history.shape == (2, 3, 4)  # fc1/fc2 x (input, weight, grad)
    assert (history[..., 0] > 0).all() and (history[..., 1:] == 0).all()
    fresh = _tiny_model()
    fresh.load_state_dict(state)
    assert torch.equal(fresh.state_dict()["model.layers.0.layernorm_mlp._extra_state"], history)


def test_bf16_layer_policy_keeps_chosen_layers_out_of_fp8():
    s = schedule([{}, {"precision": "fp8", "start_step": 1, "recipe": "current"}], bf16_first_layers=1)
    model = _tiny_model(s)
    ids = torch.randint(0, 256, (2, 17))
    with s.autocast(1):
        model.training_loss(ids[:, :-1], ids[:, 1:]).loss.backward()
    s.end_step()
    assert getattr(model.model.layers[0].layernorm_mlp, "_fp8_emu_state", None) is None
    assert model.model.layers[1].layernorm_mlp._fp8_emu_state is not None


@pytest.mark.parametrize("fp8_head", [False, True])
def test_the_lm_head_is_fp8_only_when_asked(fp8_head):
    """By default FP8 phases keep the head in BF16 (as LLM-jp did); ``precision.fp8_lm_head`` quantises it like a
    decoder layer's GEMM, with its own scaling state in ``lm_head._extra_state``."""
    s = schedule([{"precision": "fp8", "start_step": 0, "recipe": "current"}], fp8_lm_head=fp8_head)
    model = _tiny_model(s, fp8_lm_head=fp8_head)
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


def test_recompute_under_activation_checkpointing_sees_the_same_fp8_state():
    s = schedule([{}, {"precision": "fp8", "start_step": 1, "recipe": "delayed"}])
    grads = []
    for ckpt in (False, True):
        model = _tiny_model(s).train()
        model.activation_checkpointing = ckpt
        ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
        with s.autocast(0):  # a BF16 step fills the history first (as calibration would)
            pass
        with s.autocast(1):
            loss = model.training_loss(ids[:, :-1], ids[:, 1:]).loss
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


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
