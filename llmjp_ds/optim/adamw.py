"""AdamW with the LLM-jp parameter groups (weight decay on matrices, ``wd_mult`` as megatron-core's groups), the
optimizer that skips a non-finite step where no DeepSpeed wrapper does, and setting a step's LR and weight decay
(the schedule itself: :mod:`llmjp_ds.optim.lr_schedule`)."""

from __future__ import annotations

import torch


def parameter_groups(model, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (and embeddings), not on norm weights (1-D). ``wd_mult`` scales the scheduled
    weight decay per group (:func:`set_lr`), as megatron-core's param groups carry it. Each group has a ``name``,
    which DeepSpeed's split of an MoE model's groups needs (``build_optimizer``'s ``split_groups``)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay, "wd_mult": 1.0, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0, "name": "no_decay"}]
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


def build_optimizer(model, optim_cfg, skip_nonfinite: bool = False, split_groups=None):
    """AdamW with the LLM-jp groups; ``skip_nonfinite`` where no DeepSpeed wrapper checks gradients (see above).
    ``split_groups(groups)``: the groups as the optimizer gets them (an MoE model's expert parameters moved into
    groups of their own, DeepSpeed's ``split_params_into_different_moe_groups_for_optimizer``); empty ones are
    dropped."""
    on_cuda = next(model.parameters()).is_cuda
    cls = SkipNonFiniteAdamW if skip_nonfinite else torch.optim.AdamW
    groups = parameter_groups(model, optim_cfg.weight_decay)
    if split_groups is not None:
        groups = [g for g in split_groups(groups) if g["params"]]
    return cls(groups, lr=optim_cfg.lr,
               betas=(optim_cfg.beta1, optim_cfg.beta2), eps=optim_cfg.eps,
               **({"fused": True} if on_cuda else {"foreach": True}))


def set_lr(optimizer, lr: float, weight_decay: float | None = None) -> None:
    """The LR of every param group and, if given, the weight decay of each scaled by its ``wd_mult``, as
    megatron-core's scheduler sets them. A group without ``wd_mult`` keeps decaying if it decays now: loading a
    checkpoint of an earlier release puts back its groups, which had none (torch's and DeepSpeed's
    ``load_state_dict`` replace the groups' settings with the saved ones)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
        if weight_decay is not None:
            group.setdefault("wd_mult", 1.0 if group.get("weight_decay") else 0.0)
            group["weight_decay"] = weight_decay * group["wd_mult"]
