"""One-pass fp32 gradient accumulation inside DeepSpeed's ``BF16_Optimizer``: the one place that reaches into
DeepSpeed's internals.

Every private name used here, read from DeepSpeed 0.19.8's ``deepspeed/runtime/bf16_optimizer.py``:

* ``_update_hp_grad(lp, group_idx, param_idx, clear_lp_grads)``: the method the grad hooks call to add a bf16
  gradient into the fp32 buffer (replaced here);
* ``fp32_groups_gradients[i][j]``: the fp32 gradient buffer of parameter ``j`` of group ``i``;
* ``fp32_groups_has_gradients[i][j]``: the flag ``get_grads_for_norm`` and the step read;
* ``bf16_groups[i][j]``: the bf16 parameters, in the same order;
* ``immediate_grad_update``: DeepSpeed's ``bf16.immediate_grad_update`` (the hook path);
* ``lp._hp_grad``: the attribute DeepSpeed sets on a bf16 parameter to its fp32 gradient.

If a DeepSpeed lacks any of them the run keeps DeepSpeed's own accumulation and says so in one line.
"""

from __future__ import annotations

import torch

BF16_OPTIMIZER_INTERNALS = ("_update_hp_grad", "fp32_groups_gradients", "fp32_groups_has_gradients", "bf16_groups",
                            "immediate_grad_update")


def fuse_grad_accumulation(optimizer, modules) -> int:
    """FP32 gradient accumulation in one pass, for DeepSpeed's ``BF16_Optimizer`` (bf16 + ZeRO-1 or pipeline
    with ``grad_accum_dtype`` fp32, ``ds_configs/zero1.json`` and ``pipeline.json``).

    Per micro-batch and parameter DeepSpeed casts the bf16 gradient to a new fp32 tensor and then adds it to the
    fp32 buffer: two kernels and 22 bytes of memory traffic per parameter (its measured cost is in
    docs/performance.md). Here (1) that add reads the bf16 gradient directly (``add_`` promotes inside the
    kernel: one pass, 10 bytes, the same fp32 result bit for bit), and (2) with ``immediate_grad_update`` the
    weights a module lists in ``MAIN_GRAD_WEIGHTS`` (TE's GEMM weights in ``te_layers``; the embedding and LM
    head in ``model/main_grad.py``) get DeepSpeed's fp32 buffer as ``main_grad`` and ``fuse_wgrad_accumulation``:
    the module's backward accumulates into it in fp32 (no bf16 rounding of each micro-batch's gradient) and
    returns a placeholder, which the hook drops. Returns the number of weights accumulated that way."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer  # DeepSpeed 0.19.8

    if not isinstance(optimizer, BF16_Optimizer):
        return 0
    if not all(hasattr(optimizer, name) for name in BF16_OPTIMIZER_INTERNALS):
        print("[llmjp-ds] this DeepSpeed's BF16_Optimizer lacks the fields parallel.fused_grad_accumulation "
              "uses: accumulating gradients DeepSpeed's way", flush=True)
        return 0
    hp_grads, has_grads = optimizer.fp32_groups_gradients, optimizer.fp32_groups_has_gradients

    @torch.no_grad()
    def update_hp_grad(lp, group_idx, param_idx, clear_lp_grads):
        if lp.grad is None:
            return
        hp = hp_grads[group_idx][param_idx]
        if getattr(lp, "grad_added_to_main_grad", False):
            lp.grad_added_to_main_grad = False  # the GEMM accumulated into hp; lp.grad is TE's placeholder
        else:
            hp.add_(lp.grad.view(hp.shape))
        lp._hp_grad = hp
        has_grads[group_idx][param_idx] = True
        if clear_lp_grads:
            lp.grad.zero_()

    # DeepSpeed 0.19.8: BF16_Optimizer's grad hooks (immediate_grad_update) and update_hp_grads() call
    # self._update_hp_grad(lp, group_idx, param_idx, clear_lp_grads) once per parameter and micro-batch
    optimizer._update_hp_grad = update_hp_grad
    if not optimizer.immediate_grad_update:
        return 0
    where = {id(lp): (i, j) for i, group in enumerate(optimizer.bf16_groups) for j, lp in enumerate(group)}
    fused = 0
    for module in modules:
        names = getattr(module, "MAIN_GRAD_WEIGHTS", ())
        weights = [getattr(module, name) for name in names]
        if not weights or not all(id(w) in where for w in weights):
            continue
        for w in weights:
            i, j = where[id(w)]
            w.main_grad = hp_grads[i][j].view(w.shape)
            w.grad_added_to_main_grad = False
        module.fuse_wgrad_accumulation = True
        fused += len(weights)
    return fused
