"""CPU FP8 emulation (``precision/emulation.py``): every recipe quantises forward and backward, the amax
history travels in ``_extra_state``, and a recompute under activation checkpointing sees the forward's scales."""

from __future__ import annotations

import pytest
import torch

from llmjp_ds.model.options import ModelOptions
from tests.precision.helpers import schedule, tiny_model


@pytest.mark.parametrize("recipe", ["delayed", "current", "block"])
def test_emulated_fp8_quantises_forward_and_backward(recipe):
    s = schedule([{}, {"precision": "fp8", "start_step": 3, "recipe": recipe, "calibration_steps": 1}])
    model = tiny_model(s)
    ids = torch.randint(0, 256, (2, 33))
    ref = model.training_loss(ids[:, :-1], ids[:, 1:]).loss
    ref.backward()
    ref_grad = model.model.layers[0].layernorm_mlp.fc1_weight.grad.clone()
    model.zero_grad()
    for step in (2, 3):  # step 2 calibrates (delayed), step 3 runs in FP8
        with s.autocast(step):
            loss = model.training_loss(ids[:, :-1], ids[:, 1:]).loss
        if step == 2 and recipe == "delayed":
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
    s = schedule([{}, {"precision": "fp8", "start_step": 2, "amax_history_len": 4}])
    model = tiny_model(s)
    ids = torch.randint(0, 256, (2, 17))
    with s.autocast(2):
        model.training_loss(ids[:, :-1], ids[:, 1:]).loss.backward()
    s.end_step()
    state = model.state_dict()
    history = state["model.layers.0.layernorm_mlp._extra_state"]
    assert history.dtype == torch.float32 and history.shape == (2, 3, 4)  # fc1/fc2 x (input, weight, grad)
    assert (history[..., 0] > 0).all() and (history[..., 1:] == 0).all()
    fresh = tiny_model()
    fresh.load_state_dict(state)
    assert torch.equal(fresh.state_dict()["model.layers.0.layernorm_mlp._extra_state"], history)


def test_recompute_under_activation_checkpointing_sees_the_same_fp8_state():
    s = schedule([{}, {"precision": "fp8", "start_step": 2, "recipe": "delayed"}])
    grads = []
    for recompute in ("none", "full"):
        model = tiny_model(s, options=ModelOptions(recompute=recompute)).train()
        ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
        with s.autocast(1):  # a BF16 step fills the history first (as calibration would)
            pass
        with s.autocast(2):
            loss = model.training_loss(ids[:, :-1], ids[:, 1:]).loss
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_an_expert_with_no_tokens_keeps_its_amax_history_and_gets_a_zero_gradient(recipe):
    """Under emulated FP8 a grouped linear whose expert got no rows this micro-batch computes nothing for it: its
    gradient is zero, the amax history of its input and gradient records 0 and no NaN (its weight's is the
    weight's); the experts that got rows are quantised as any linear."""
    from llmjp_ds.model import torch_layers
    from llmjp_ds.precision.emulation import GRAD, INPUT, WEIGHT

    s = schedule([{}, {"precision": "fp8", "start_step": 2, "recipe": recipe, "amax_history_len": 4}])
    torch.manual_seed(0)
    grouped = torch_layers.GroupedLinear(3, 16, 8, init_std=0.02)
    s.attach(grouped, [], 1)
    rows = torch.randn(5, 16, requires_grad=True)
    with s.autocast(2):
        out = grouped(rows, [2, 0, 3])
    out.square().sum().backward()
    s.end_step()
    assert torch.count_nonzero(grouped.weight1.grad) == 0
    assert torch.count_nonzero(grouped.weight0.grad) > 0 and torch.count_nonzero(grouped.weight2.grad) > 0
    history = grouped._fp8_emu_state
    assert torch.isfinite(history).all()
    assert history[1, INPUT].abs().sum() == history[1, GRAD].abs().sum() == 0 < history[1, WEIGHT, 0]
    reference = torch.cat([rows[:2] @ grouped.weight0.t(), rows[2:] @ grouped.weight2.t()])
    assert 0 < (out - reference).abs().max() < 0.1 * reference.abs().max()
