"""The residual stream's gradient, added inside the next norm's backward instead of by autograd.

A pre-norm block is ``h = x + branch(norm(x))``. Autograd gives ``x`` two gradients, the residual's ``dh`` and the
branch's through the norm, and adds them in a kernel of its own: it reads both and writes the sum, three passes
over the hidden states, at each of a decoder layer's two residual adds. :func:`residual_add` hands ``dh`` over to
the norm's backward instead, which reads it once more and writes ``x``'s whole gradient (TE's
``rmsnorm_bwd_add``, ``te_layers``; ``model.fused_residual_norm``): one pass instead of three.

The hand-over is a single slot. The add's backward runs before its branch's (the branch feeds it), and the first
norm backward after it is the branch's own. The slot is keyed by the storage of ``x``, which the norm keeps for
its backward: a norm that finds a gradient meant for another tensor raises, and so does an add whose slot is still
full or a backward pass that ends with it full, instead of dropping a gradient. A recomputed branch
(``model.recompute: full``) saves a recomputed ``x``, not the one the add saw, so the Trainer leaves the fusion
off there.
"""

from __future__ import annotations

import torch


def _key(x: torch.Tensor) -> tuple[int, int]:
    return x.data_ptr(), x.numel()


class _Slot:
    key: tuple[int, int] | None = None
    grad: torch.Tensor | None = None


_slot = _Slot()


def hand_over(x: torch.Tensor | tuple[int, int], grad: torch.Tensor) -> None:
    """Leave ``grad`` for the norm backward whose input is ``x`` (a tensor or its key)."""
    _all_taken()
    _slot.key, _slot.grad = (x if isinstance(x, tuple) else _key(x)), grad


def take(x: torch.Tensor) -> torch.Tensor | None:
    """The residual gradient left for the norm input ``x``, shaped as ``x``, or None when none is pending."""
    if _slot.key is None:
        return None
    key, grad, _slot.key, _slot.grad = _slot.key, _slot.grad, None, None
    if key != _key(x):
        raise RuntimeError(f"a norm's backward found the residual gradient of another tensor ({key[0]:#x}, "
                           f"{key[1]} elements; its own input is at {x.data_ptr():#x}); set "
                           "model.fused_residual_norm=false")
    return grad.reshape(x.shape).contiguous()


def pending() -> bool:
    return _slot.key is not None


class _ResidualAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, residual, branch):
        ctx.key = _key(residual)
        return residual + branch

    @staticmethod
    def backward(ctx, grad):
        if ctx.needs_input_grad[0]:
            hand_over(ctx.key, grad)
            torch.autograd.Variable._execution_engine.queue_callback(_all_taken)
        return None, grad


def _all_taken() -> None:
    """Run when the backward pass ends: a gradient still in the slot was never added to its residual's."""
    if _slot.key is not None:
        held, _slot.key, _slot.grad = _slot.key, None, None
        raise RuntimeError(f"the residual gradient for the tensor at {held[0]:#x} was never taken by its norm's "
                           "backward; set model.fused_residual_norm=false")


def residual_add(residual: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    """``residual + branch``, whose gradient for ``residual`` goes to the norm backward that reads ``residual``
    (:func:`take`) instead of being added by autograd. A plain add where no gradient is recorded."""
    if torch.is_grad_enabled() and (residual.requires_grad or branch.requires_grad):
        return _ResidualAdd.apply(residual, branch)
    return residual + branch
