"""The residual gradient handed to the next norm's backward (``model.fused_residual_norm``) gives autograd's
gradients, and a hand-over that goes astray raises instead of losing a gradient.

The norm here is a plain-PyTorch RMSNorm whose backward takes the residual gradient as TE's does through
``te_layers`` (``rmsnorm_bwd_add``); the GPU test in ``test_backends.py`` runs TE's kernel.
"""

from __future__ import annotations

import pytest
import torch

from llmjp_ds.model import residual_grad
from llmjp_ds.model.residual_grad import residual_add


class _RMSNorm(torch.autograd.Function):
    """RMSNorm with its backward written out; the residual gradient left for ``x`` is added to ``x``'s."""

    @staticmethod
    def forward(ctx, x, w):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        ctx.save_for_backward(x, w, rstd)
        return x * rstd * w

    @staticmethod
    def backward(ctx, dy):
        x, w, rstd = ctx.saved_tensors
        xhat = x * rstd
        g = dy * w
        dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
        add = residual_grad.take(x)
        return (dx if add is None else dx + add), (dy * xhat).sum(dim=tuple(range(dy.dim() - 1)))


def _blocks(x, weights, add):
    """Two pre-norm blocks, ``x + tanh(norm(x) @ w)``, with ``add`` as the residual add."""
    for norm_w, w in weights:
        x = add(x, torch.tanh(_RMSNorm.apply(x, norm_w) @ w))
    return x


def _grads(add):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    weights = [(torch.rand(16, dtype=torch.float64).add(0.5).requires_grad_(True),
                (torch.randn(16, 16, dtype=torch.float64) / 4).requires_grad_(True)) for _ in range(3)]
    out = _blocks(x, weights, add)
    out.backward(torch.randn_like(out))
    return [out.detach(), x.grad] + [t.grad for pair in weights for t in pair]


def test_handed_over_residual_gradients_equal_autograds_sum():
    fused, plain = _grads(residual_add), _grads(torch.add)
    assert not residual_grad.pending()
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)


def test_an_add_outside_autograd_is_plain():
    x, y = torch.randn(4, requires_grad=True), torch.randn(4)
    with torch.no_grad():
        out = residual_add(x, y)
    assert out.grad_fn is None and torch.equal(out, x.detach() + y)


def test_a_gradient_no_norm_takes_is_refused_when_the_backward_ends():
    """A residual whose branch has no norm that takes its gradient: the gradient would be lost, so the backward
    pass raises when it ends (and empties the slot for the next step)."""
    x = torch.randn(2, 8, requires_grad=True)
    h = residual_add(x, torch.tanh(x))  # tanh, not a norm that takes the gradient
    out = residual_add(h, _RMSNorm.apply(h, torch.ones(8)))
    with pytest.raises(RuntimeError, match="never taken by its norm's backward.*fused_residual_norm=false"):
        out.sum().backward()
    assert not residual_grad.pending()
    residual_grad.hand_over(x, torch.ones(2, 8))
    with pytest.raises(RuntimeError, match="never taken"):  # an add whose slot is still full
        residual_grad.hand_over(h, torch.ones(2, 8))


def test_a_norm_finding_another_tensors_gradient_raises():
    x, other = torch.randn(2, 8), torch.randn(2, 8)
    residual_grad.hand_over(other, torch.ones(2, 8))
    with pytest.raises(RuntimeError, match="residual gradient of another tensor"):
        residual_grad.take(x)
    assert not residual_grad.pending()
    residual_grad.hand_over(x, torch.ones(16))
    assert torch.equal(residual_grad.take(x.view(16)), torch.ones(16))  # a view of the same storage, reshaped
