"""Causal-LM loss with the optional z-loss (PaLM / LLM-jp: ``coeff * logsumexp(logits)^2``), reported apart.

Over a 100k vocabulary the logits of one micro-batch are the largest tensor of the step (4096 x 99840 bf16 =
0.8 GB per sequence). The eager formula makes an fp32 copy of them, keeps it for the backward and writes an
fp32 gradient the size of it again. ``fused=True`` runs the same formula through ``torch.compile``: the fp32
cast happens in registers inside one reduction kernel (and one pointwise backward kernel that writes the bf16
gradient directly), so no fp32 logits ever exist in memory. Same math, same result to fp32 rounding. On a CUDA
device ``fused=True`` runs two streaming Triton kernels instead (:mod:`llmjp_ds.model.kernels.cross_entropy`),
whose backward writes the gradient over the logits, so no second logits-sized buffer exists either.

Under tensor parallelism the logits are vocabulary-parallel (each rank holds ``[s, b, V / tp]``) and no rank ever
holds a full row: :func:`_vocab_parallel_terms` all-reduces the row maxima, the sums of exponentials and the
target logits (from the rank owning each id) over the group, and builds the same log-sum-exp both terms use.
"""

from __future__ import annotations

import os
import sys
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from llmjp_ds.errors import fail
from llmjp_ds.model.kernels import cross_entropy
from llmjp_ds.model.tensor_parallel import TensorParallel, reduce_from

IGNORE_INDEX = -100


class LossParts(NamedTuple):
    loss: torch.Tensor  # what is backpropagated: lm_loss + z_loss
    lm_loss: torch.Tensor
    z_loss: torch.Tensor


def _mean_terms(log_z: torch.Tensor, target_logit: torch.Tensor, keep: torch.Tensor, z_loss_coeff: float):
    """(loss, lm_loss, z_loss): the means over kept positions of ``log_z - target_logit`` and ``log_z^2``."""
    count = keep.sum().clamp(min=1)
    lm_loss = ((log_z - target_logit) * keep).sum() / count
    if z_loss_coeff:
        z_loss = z_loss_coeff * (log_z.pow(2) * keep).sum() / count
    else:
        z_loss = torch.zeros((), device=log_z.device)
    return lm_loss + z_loss, lm_loss, z_loss


def _loss_terms(logits: torch.Tensor, targets: torch.Tensor, z_loss_coeff: float):
    logits = logits.float().reshape(-1, logits.shape[-1])
    targets = targets.reshape(-1)
    log_z = torch.logsumexp(logits, dim=-1)
    target_logit = logits.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)
    return _mean_terms(log_z, target_logit, targets != IGNORE_INDEX, z_loss_coeff)


def _vocab_parallel_terms(logits: torch.Tensor, targets: torch.Tensor, z_loss_coeff: float, tp: TensorParallel):
    """:func:`_loss_terms` over vocabulary-parallel ``logits [s, b, V / tp]`` and ``targets [b, s]``."""
    local_vocab = logits.shape[-1]
    logits = logits.float().reshape(-1, local_vocab)
    targets = targets.t().reshape(-1)  # sequence-first, as the logits
    row_max = logits.detach().max(dim=-1).values  # log-sum-exp does not depend on it: no gradient needed
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp.group)
    log_z = row_max + reduce_from((logits - row_max.unsqueeze(1)).exp().sum(dim=-1), tp).log()
    local = targets - tp.rank * local_vocab
    owned = (local >= 0) & (local < local_vocab)
    mine = logits.gather(1, local.clamp(0, local_vocab - 1).unsqueeze(1)).squeeze(1) * owned
    return _mean_terms(log_z, reduce_from(mine, tp), targets != IGNORE_INDEX, z_loss_coeff)


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor, z_loss_coeff: float = 0.0) -> LossParts:
    """Mean token cross-entropy of ``logits [..., V]`` against already-shifted ``targets [...]``, in fp32 (eager).

    Positions whose target is ``IGNORE_INDEX`` count in neither term.
    """
    return LossParts(*_loss_terms(logits, targets, z_loss_coeff))


# ATen's CPU capability -> the vector width (bits) of the compiled loss's kernels (1: scalar)
SIMD_BITS = {"DEFAULT": 1, "AVX2": 256, "AVX512": 512}


def _compile_options(logits: torch.Tensor) -> dict:
    """Inductor's CPU kernels at the vector width of ATen's capability (``ATEN_CPU_CAPABILITY``). Left to itself
    (torch 2.13) it vectorised for the processor while ATen's vector headers followed the capability: under
    ``default`` the loss's reductions did not compile, and since its cache key does not hold the capability, an
    AVX512 kernel built earlier was loaded under ``avx2`` and crashed the process."""
    bits = SIMD_BITS.get(torch.backends.cpu.get_cpu_capability()) if logits.device.type == "cpu" else None
    return {"cpp.simdlen": bits} if bits else {}


# the fused loss on a CUDA device: "triton" (llmjp_ds.model.kernels.cross_entropy) or "compiled" (torch.compile);
# $LLMJP_DS_FUSED_LOSS picks one for a comparison (llmjp-ds bench)
GPU_FUSED_LOSS = ("triton", "compiled")


def gpu_fused_loss() -> str:
    name = os.environ.get("LLMJP_DS_FUSED_LOSS", GPU_FUSED_LOSS[0])
    if name not in GPU_FUSED_LOSS:
        fail(f"LLMJP_DS_FUSED_LOSS must be one of {', '.join(GPU_FUSED_LOSS)}, got {name!r}")
    return name


class CausalLMLoss:
    """:func:`causal_lm_loss` with a fixed z-loss coefficient; ``fused`` runs it compiled (module docstring), or
    on a CUDA device as two streaming Triton kernels whose backward writes the gradient over the logits
    (:mod:`llmjp_ds.model.kernels.cross_entropy`; :func:`gpu_fused_loss` says which). :meth:`overwrites` tells
    the model whether the logits it passes will be overwritten (it then does not return them).

    The compiled function is built on first use and kept by this object. If no compiler works, one line goes to
    stderr and this object uses the eager formula from then on. With ``tp`` the logits are vocabulary-parallel
    (:func:`_vocab_parallel_terms`, eager: its collectives sit between the reductions)."""

    def __init__(self, z_loss_coeff: float = 0.0, fused: bool = False, tp: TensorParallel | None = None):
        self.z_loss_coeff = z_loss_coeff
        self.fused = fused
        self.tp = tp
        self.compiled = None  # the compiled formula; False once compiling failed

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> LossParts:
        if self.tp is not None:
            return LossParts(*_vocab_parallel_terms(logits, targets, self.z_loss_coeff, self.tp))
        if self.overwrites(logits):
            return LossParts(*cross_entropy.cross_entropy_z_loss(logits, targets, self.z_loss_coeff, IGNORE_INDEX))
        if self.fused and self.compiled is not False:
            try:
                if self.compiled is None:
                    self.compiled = torch.compile(_loss_terms, dynamic=False, fullgraph=True,
                                                  options=_compile_options(logits))
                return LossParts(*self.compiled(logits, targets, self.z_loss_coeff))
            except Exception as exc:  # no working compiler toolchain: the eager formula is the same math
                if isinstance(exc, torch.cuda.OutOfMemoryError):
                    raise
                self.compiled = False
                first_line = (str(exc).splitlines() or [""])[0][:200]
                print(f"[llmjp-ds] fused loss unavailable ({type(exc).__name__}: {first_line}); using the eager "
                      "loss", file=sys.stderr, flush=True)
        return causal_lm_loss(logits, targets, self.z_loss_coeff)

    def overwrites(self, logits: torch.Tensor) -> bool:
        """Whether this loss of ``logits`` runs the Triton kernels, whose backward reuses the logits' memory."""
        if not (self.fused and self.tp is None and logits.is_cuda and gpu_fused_loss() == "triton"):
            return False

        return cross_entropy.supported(logits)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """HF convention: ``labels`` align with ``input_ids``; position t predicts labels[t + 1]."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)
