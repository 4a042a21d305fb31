"""Causal-LM loss with the optional z-loss (PaLM / LLM-jp: ``coeff * logsumexp(logits)^2``), reported apart."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


class LossParts(NamedTuple):
    loss: torch.Tensor  # what is backpropagated: lm_loss + z_loss
    lm_loss: torch.Tensor
    z_loss: torch.Tensor


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor, z_loss_coeff: float = 0.0) -> LossParts:
    """Mean token cross-entropy of ``logits [..., V]`` against already-shifted ``targets [...]``, in fp32.

    Positions whose target is ``IGNORE_INDEX`` count in neither term.
    """
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
    return LossParts(lm_loss + z_loss, lm_loss, z_loss)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """HF convention: ``labels`` align with ``input_ids``; position t predicts labels[t + 1]."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)
