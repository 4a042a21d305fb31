"""Emulated FP8 for the pure-PyTorch backend: the same recipes as TE, with torch's float8 dtypes.

Used where Transformer Engine cannot run (CPU, CI) and only when ``precision.emulate_fp8`` asks for it; every
log line of such a phase says ``emulated``. Each GEMM casts its input and weight to ``float8_e4m3fn`` and its
output gradient to ``float8_e5m2`` (``hybrid``) or ``float8_e4m3fn`` (``e4m3``), scaled per tensor:

* ``delayed``: scale from the amax history (``max`` or ``most_recent``) of earlier iterations;
* ``current``: scale from this tensor's own amax;
* ``block``: scales per 1x128 tile along the last dimension.

As in TE, the forward and backward histories roll separately: the input and weight amax values of a
forward region are committed when the next region starts (so an activation recompute inside the same
micro-batch sees the same scales as the forward did), and a GEMM's output-gradient amax when that GEMM's next
backward starts. Each backward thus sees the amax of every earlier backward and nothing else, whatever order
a pipeline schedule interleaves forwards and backwards in. Histories live in the module's ``_extra_state`` (a
float tensor ``[gemms, 3 (input, weight, grad), history]``) and so travel with checkpoints.

An :class:`FP8Emulator` is owned by the precision schedule; the torch-backend modules it is attached to
(``module.fp8_emulator``) route their GEMMs through :meth:`FP8Emulator.linear` while one of its regions is open.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from llmjp_ds.model.attach import emulated_history

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
INPUT, WEIGHT, GRAD = 0, 1, 2


def _slot(module, weight) -> int:
    mats = [p for p in module.parameters(recurse=False) if p.dim() == 2]
    for i, p in enumerate(mats):
        if p is weight:
            return i
    return 0


def _state(module, phase) -> torch.Tensor:
    gemms = max(1, sum(1 for p in module.parameters(recurse=False) if p.dim() == 2))
    return emulated_history(module, gemms, phase.amax_history_len)


def _amax(t: torch.Tensor) -> torch.Tensor:
    """``max |t|``; 0 for an empty tensor (an expert that got no tokens this micro-batch)."""
    return t.abs().amax() if t.numel() else t.new_zeros(())


def _roll(history: torch.Tensor, newest: torch.Tensor) -> None:
    history.copy_(torch.cat([newest.unsqueeze(-1), history[..., :-1]], dim=-1))


def _quantize(t: torch.Tensor, fmt: str, phase, history: torch.Tensor) -> torch.Tensor:
    fmax = FP8_MAX[fmt]
    if phase.recipe == "block":
        tile = 128 if t.shape[-1] % 128 == 0 else t.shape[-1]
        tiles = t.reshape(*t.shape[:-1], t.shape[-1] // tile, tile)
        amax = tiles.abs().amax(-1, keepdim=True).float().clamp(min=1e-12)
        scale = fmax / amax
        q = (tiles.float() * scale).clamp(-fmax, fmax).to(FP8_DTYPES[fmt]).float() / scale
        return q.reshape(t.shape).to(t.dtype)
    if phase.recipe == "current":
        amax = _amax(t).float()
    else:
        amax = history.max() if phase.amax_compute_algo == "max" else history[0]
    scale = fmax / amax / (2.0 ** phase.margin) if float(amax) > 0 else torch.tensor(1.0)
    return ((t.float() * scale).clamp(-fmax, fmax).to(FP8_DTYPES[fmt]).float() / scale).to(t.dtype)


class FP8Emulator:
    """The emulation's state: the open region (phase, calibrating) and the amax values not yet committed."""

    def __init__(self):
        self.active: tuple | None = None  # (phase, calibrating) inside a region
        self._pending_forward: dict = {}  # module -> [gemms, 2] input/weight amax of the open region
        self._pending_grad: dict = {}  # (module, gemm) -> output-gradient amax of that GEMM's last backward
        self.amax_group = None  # a process group: every amax is MAX-reduced over it (under tensor parallelism)
        self.reduces_amax = False

    def reduce_amax_over(self, group) -> None:
        """Reduce each recorded amax over ``group`` (None: the world), as TE's amax reduction group does."""
        self.amax_group, self.reduces_amax = group, True

    def _reduced(self, amax: torch.Tensor) -> torch.Tensor:
        amax = amax.detach().float()
        if self.reduces_amax:
            import torch.distributed as dist

            amax = amax.clone()
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.amax_group)
        return amax.cpu()

    @contextlib.contextmanager
    def region(self, phase, calibrating: bool = False):
        """Emulated-FP8 region for one micro-batch (``calibrating``: BF16 math, amax recorded)."""
        self.commit_forward()
        with self._activated((phase, calibrating)):
            yield

    @contextlib.contextmanager
    def _activated(self, active):
        previous, self.active = self.active, active
        try:
            yield
        finally:
            self.active = previous

    def checkpoint(self, function, *args):
        """Activation checkpointing (non-reentrant) whose recompute runs in the region its forward ran in."""
        saved = self.active
        return torch.utils.checkpoint.checkpoint(
            function, *args, use_reentrant=False,
            context_fn=lambda: (contextlib.nullcontext(), self._activated(saved)))

    def linear(self, module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.active is None:
            return F.linear(x, weight)
        phase, calibrating = self.active
        return _EmulatedFP8Linear.apply(x, weight, module, _slot(module, weight), phase, calibrating, self)

    # --- amax bookkeeping -----------------------------------------------------------------------------
    def commit_forward(self) -> None:
        """Fold the input and weight amax values of the open forward region into the histories (newest first)."""
        for module, amax in self._pending_forward.items():
            _roll(module._fp8_emu_state[:, :GRAD], amax)
        self._pending_forward.clear()

    def commit_grad(self, key) -> None:
        amax = self._pending_grad.pop(key, None)
        if amax is not None:
            module, slot = key
            _roll(module._fp8_emu_state[slot, GRAD], amax)

    def commit(self) -> None:
        """Fold every amax value recorded since the last commit into the histories (after a step, an evaluation)."""
        self.commit_forward()
        for key in list(self._pending_grad):
            self.commit_grad(key)

    def record_forward(self, module, slot: int, kind: int, amax: torch.Tensor) -> None:
        buf = self._pending_forward.setdefault(module, torch.zeros(module._fp8_emu_state.shape[0], GRAD))
        buf[slot, kind] = torch.maximum(buf[slot, kind], self._reduced(amax))

    def record_grad(self, module, slot: int, amax: torch.Tensor) -> None:
        self.commit_grad((module, slot))  # the previous backward's amax, before this one's is recorded
        self._pending_grad[(module, slot)] = self._reduced(amax)


class _EmulatedFP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, module, slot, phase, calibrating, emulator):
        state = _state(module, phase)
        emulator.record_forward(module, slot, INPUT, _amax(x))
        emulator.record_forward(module, slot, WEIGHT, _amax(weight))
        if not calibrating:
            x = _quantize(x, "e4m3", phase, state[slot, INPUT])
            weight = _quantize(weight, "e4m3", phase, state[slot, WEIGHT])
        ctx.save_for_backward(x, weight)
        ctx.meta = (module, slot, phase, calibrating, emulator)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        module, slot, phase, calibrating, emulator = ctx.meta
        emulator.record_grad(module, slot, _amax(grad))
        if not calibrating:
            fmt = "e5m2" if phase.fp8_format == "hybrid" else "e4m3"
            grad = _quantize(grad, fmt, phase, module._fp8_emu_state[slot, GRAD])
        grad_x = grad @ weight
        grad_w = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return grad_x, grad_w, None, None, None, None, None
