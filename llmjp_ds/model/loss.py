"""Causal-LM loss with the optional z-loss (PaLM / LLM-jp: ``coeff * logsumexp(logits)^2``), reported apart.

Over a 100k vocabulary the logits of one micro-batch are the largest tensor of the step (4096 x 99840 bf16 =
0.8 GB per sequence). The eager formula makes an fp32 copy of them, keeps it for the backward and writes an
fp32 gradient the size of it again. ``fused=True`` runs the same formula through ``torch.compile``: the fp32
cast happens in registers inside one reduction kernel (and one pointwise backward kernel that writes the bf16
gradient directly), so no fp32 logits ever exist in memory. Same math, same result to fp32 rounding.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


class LossParts(NamedTuple):
    loss: torch.Tensor  # what is backpropagated: lm_loss + z_loss
    lm_loss: torch.Tensor
    z_loss: torch.Tensor


def _loss_terms(logits: torch.Tensor, targets: torch.Tensor, z_loss_coeff: float):
    logits = logits.float().reshape(-1, logits.shape[-1])
    targets = targets.reshape(-1)
    keep = targets != IGNORE_INDEX
    count = keep.sum().clamp(min=1)
    log_z = torch.logsumexp(logits, dim=-1)
    target_logit = logits.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)
    lm_loss = ((log_z - target_logit) * keep).sum() / count
    if z_loss_coeff:
        z_loss = z_loss_coeff * (log_z.pow(2) * keep).sum() / count
    else:
        z_loss = torch.zeros((), device=logits.device)
    return lm_loss + z_loss, lm_loss, z_loss


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor, z_loss_coeff: float = 0.0) -> LossParts:
    """Mean token cross-entropy of ``logits [..., V]`` against already-shifted ``targets [...]``, in fp32 (eager).

    Positions whose target is ``IGNORE_INDEX`` count in neither term.
    """
    return LossParts(*_loss_terms(logits, targets, z_loss_coeff))


class CausalLMLoss:
    """:func:`causal_lm_loss` with a fixed z-loss coefficient; ``fused`` runs it compiled (module docstring).

    The compiled function is built on first use and kept by this object. If no compiler works, one line goes to
    stderr and this object uses the eager formula from then on."""

    def __init__(self, z_loss_coeff: float = 0.0, fused: bool = False):
        self.z_loss_coeff = z_loss_coeff
        self.fused = fused
        self.compiled = None  # the compiled formula; False once compiling failed

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> LossParts:
        if self.fused and self.compiled is not False:
            try:
                if self.compiled is None:
                    self.compiled = torch.compile(_loss_terms, dynamic=False, fullgraph=True)
                return LossParts(*self.compiled(logits, targets, self.z_loss_coeff))
            except Exception as exc:  # no working compiler toolchain: the eager formula is the same math
                if isinstance(exc, torch.cuda.OutOfMemoryError):
                    raise
                self.compiled = False
                first_line = (str(exc).splitlines() or [""])[0][:200]
                print(f"[llmjp-ds] fused loss unavailable ({type(exc).__name__}: {first_line}); using the eager "
                      "loss", file=sys.stderr, flush=True)
        return causal_lm_loss(logits, targets, self.z_loss_coeff)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """HF convention: ``labels`` align with ``input_ids``; position t predicts labels[t + 1]."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)
