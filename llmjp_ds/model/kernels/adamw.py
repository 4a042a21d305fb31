"""AdamW on one flat fp32 partition in one Triton pass: the gradient clip, the update, and the bf16 copy of the
updated weights (``optim.fused_step``, CUDA; wired into DeepSpeed's ``BF16_Optimizer`` by
:func:`llmjp_ds.parallel.deepspeed_internals.fuse_optimizer_step`).

DeepSpeed's step makes three passes over the fp32 state after the gradient norm: the clip multiplies every fp32
gradient when the norm exceeds the clip (8 bytes per parameter), torch's fused AdamW reads the weight, the
gradient and both moments and writes three of them back (28), and ``update_lp_params`` reads the fp32 weights
again to write the bf16 ones (6). Here one kernel reads the four and writes the four: 30 bytes instead of 42,
and no host synchronisation for the clip (DeepSpeed asks the host whether the clip factor is below 1).

The reference is what it replaces: DeepSpeed's clip (``g * max_norm / (norm + 1e-6)`` when that factor is
below 1), then torch's AdamW with the same state (``step``, ``exp_avg``, ``exp_avg_sq``, laid out as torch's
fused AdamW keeps them, so checkpoints are the same), then the bf16 copy.
"""

from __future__ import annotations

import importlib.util

import torch

BLOCK = 2048


def supported(param: torch.Tensor) -> bool:
    """A contiguous fp32 CUDA tensor, with Triton installed (it ships with CUDA builds of torch)."""
    return (param.is_cuda and param.dtype == torch.float32 and param.is_contiguous()
            and importlib.util.find_spec("triton") is not None)


def clip_factor(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """DeepSpeed's clip (``clip_tensors_by_global_norm``) as a factor on the device: ``max_norm / (norm + 1e-6)``
    where that is below 1, else 1 (and 1 when clipping is off)."""
    if max_norm <= 0:
        return torch.ones((), dtype=torch.float32, device=norm.device)
    coef = max_norm / (norm.float() + 1e-6)
    return torch.where(coef < 1, coef, torch.ones_like(coef))


def init_state(state: dict, param: torch.Tensor) -> None:
    """The state torch's fused AdamW creates on its first step (a float32 ``step`` on the parameter's device)."""
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def adamw_step_(param: torch.Tensor, grad: torch.Tensor, state: dict, lowp: torch.Tensor, group: dict,
                clip: torch.Tensor) -> None:
    """One AdamW step of ``param`` (flat fp32) with ``grad * clip`` in place, and ``lowp`` (same length, bf16)
    set to the updated weights. ``group``: torch's parameter group (``lr``, ``betas``, ``eps``,
    ``weight_decay``); ``state``: the parameter's torch AdamW state (created if empty)."""
    import triton

    from llmjp_ds.model.kernels.adamw_triton import adamw_kernel

    if group.get("amsgrad") or group.get("maximize"):
        raise ValueError("the fused AdamW step has no amsgrad or maximize: set optim.fused_step=false")
    init_state(state, param)
    state["step"] += 1
    beta1, beta2 = group["betas"]
    lr = float(group["lr"])
    t = state["step"].double()
    # the scalars as torch's fused AdamW takes them: in float64 from the float32 step count
    coef = torch.stack([lr / (1 - torch.pow(beta1, t)), torch.sqrt(1 - torch.pow(beta2, t)), clip.double()])
    coef = coef.float()
    n = param.numel()
    if n == 0:  # nothing to launch (Triton refuses an empty grid); the step still counts, as in torch
        return
    adamw_kernel[(triton.cdiv(n, BLOCK),)](
        param, grad, state["exp_avg"], state["exp_avg_sq"], lowp, coef, n, lr, float(beta1), float(beta2),
        float(group["eps"]), float(group["weight_decay"]), BLOCK=BLOCK, num_warps=4)
