"""AdamW with the LLM-jp parameter groups, and the learning-rate schedule as a pure function."""

from __future__ import annotations

import math

import torch


def lr_at(step: int, *, lr: float, warmup_steps: int, decay_steps: int, min_lr_ratio: float) -> float:
    """Linear warmup over ``warmup_steps`` to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at
    ``decay_steps``, flat after (Megatron-LM's ``cosine`` style, as LLM-jp-3 used). ``step`` counts from 0."""
    min_lr = lr * min_lr_ratio
    if warmup_steps and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= decay_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def megatron_lr_at(step: int, *, lr: float, warmup_steps: int, decay_steps: int, min_lr_ratio: float) -> float:
    """Megatron-LM's schedule (megatron-core's ``OptimizerParamScheduler``, cosine): the LR of the step after
    ``step`` completed ones. Megatron sets the LR of an iteration from the count of iterations before it, so its
    warmup runs ``lr * step / warmup_steps`` (its first step at LR 0, ``warmup_steps`` itself at ``lr``); the
    cosine then reaches ``lr * min_lr_ratio`` at ``decay_steps``, flat after. Megatron counts in samples: these
    are its counts divided by the global batch."""
    min_lr = lr * min_lr_ratio
    if warmup_steps > 0 and step <= warmup_steps:
        return lr * step / warmup_steps
    if step > decay_steps:
        return min_lr
    progress = (step - warmup_steps) / (decay_steps - warmup_steps)
    return min_lr + 0.5 * (math.cos(math.pi * progress) + 1.0) * (lr - min_lr)


SCHEDULES = {"llmjp": lr_at, "megatron": megatron_lr_at}  # optim.schedule


def schedule_lr(step: int, optim_cfg, total_steps: int) -> float:
    return SCHEDULES[optim_cfg.schedule](step, lr=optim_cfg.lr, warmup_steps=optim_cfg.warmup_steps,
                                        decay_steps=optim_cfg.decay_steps or total_steps,
                                        min_lr_ratio=optim_cfg.min_lr_ratio)


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (and embeddings), not on norm weights (1-D)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


class SkipNonFiniteAdamW(torch.optim.AdamW):
    """AdamW that skips its update when any gradient is NaN/inf and reports it in ``overflow``, as DeepSpeed's
    ZeRO, BF16 and FP16 optimizer wrappers do (``engine.was_step_applied()`` reads it). Needed where DeepSpeed
    steps the client optimizer directly (fp32 with ZeRO-0): there nothing checks the gradients, and one
    non-finite step would turn every weight into NaN."""

    overflow = False

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        # amax, not a norm: a norm of large but finite gradients can overflow to inf; NaN propagates through amax
        self.overflow = bool(grads) and not bool(torch.stack([g.abs().amax() for g in grads]).isfinite().all())
        if self.overflow:
            return None
        return super().step(closure)


def build_optimizer(model: torch.nn.Module, optim_cfg, skip_nonfinite: bool = False) -> torch.optim.Optimizer:
    """AdamW with the LLM-jp groups; ``skip_nonfinite`` where no DeepSpeed wrapper checks gradients (see above)."""
    on_cuda = next(model.parameters()).is_cuda
    cls = SkipNonFiniteAdamW if skip_nonfinite else torch.optim.AdamW
    return cls(parameter_groups(model, optim_cfg.weight_decay), lr=optim_cfg.lr,
               betas=(optim_cfg.beta1, optim_cfg.beta2), eps=optim_cfg.eps,
               **({"fused": True} if on_cuda else {"foreach": True}))


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
