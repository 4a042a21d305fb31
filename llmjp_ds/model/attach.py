"""What other rooms hand a built model, each through one function here, so that no attribute of a model module is
set from outside this package:

* the precision room's FP8 state (:func:`attach_fp8`): the weight cache TE's GEMM modules read, the emulator the
  torch layers route their GEMMs through, and the emulated amax history each such module keeps
  (:func:`emulated_history`), which travels in its ``_extra_state``;
* the parallel room's fp32 gradient buffers (:func:`accumulate_in_main_grad`): DeepSpeed's, into which a module's
  backward accumulates its weight gradients (TE's ``main_grad`` protocol).
"""

from __future__ import annotations

import torch

from llmjp_ds.model.weight_reuse import ReusesFP8Weights


def attach_fp8(model: torch.nn.Module, weight_cache=None, emulator=None, kept_bf16=frozenset()) -> None:
    """Hand ``weight_cache`` (its ``generation`` tells when weights may have changed) to every TE GEMM module of
    ``model``, and ``emulator`` (an FP8 emulator with ``linear(module, x, weight)``) to every torch-backend module
    that routes its GEMMs through one, except the modules whose ``id`` is in ``kept_bf16``."""
    for module in model.modules():
        if weight_cache is not None and isinstance(module, ReusesFP8Weights):
            module.weight_cache = weight_cache
        if emulator is not None and hasattr(module, "fp8_emulator") and id(module) not in kept_bf16:
            module.fp8_emulator = emulator


def emulated_history(module: torch.nn.Module, gemms: int, length: int) -> torch.Tensor:
    """The emulated amax history ``[gemms, 3 (input, weight, grad), length]`` of ``module`` (zeros when it has
    none of that shape yet); updated in place by the emulator, saved in the module's ``_extra_state``."""
    state = getattr(module, "_fp8_emu_state", None)
    if state is None or state.shape != (gemms, 3, length):
        state = torch.zeros(gemms, 3, length)
        module._fp8_emu_state = state
    return state


def accumulate_in_main_grad(module: torch.nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    """``module``'s backward accumulates the gradient of each weight named in ``buffers`` into that fp32 buffer
    (its ``main_grad``) and returns a placeholder; ``module`` lists the weights it can do this for in
    ``MAIN_GRAD_WEIGHTS``."""
    for name, buffer in buffers.items():
        weight = getattr(module, name)
        weight.main_grad = buffer
        weight.grad_added_to_main_grad = False
    module.fuse_wgrad_accumulation = True
