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
