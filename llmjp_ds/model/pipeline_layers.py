"""The pipeline-parallel split, visible in one place: embedding | decoder layers | final norm + head.

The pipeline's layers are the same classes the HF model is made of, listed as :class:`StageLayer`s (a class and
its arguments, built only on the stage that holds it), with each one's training FLOPs for the partition. Plain
data and PyTorch modules: ``parallel/stages.py`` turns them into DeepSpeed's ``LayerSpec``s and the
``PipelineModule``. Activations travel between stages as one ``[b, s, h]`` tensor; RoPE angles are recomputed
per layer from the sequence length (cheap, and nothing extra crosses a stage boundary).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from llmjp_ds.model.flops import layer_and_logits_flops_for
from llmjp_ds.model.llama import DecoderLayer, Embedding, FinalNormHead, head_dim_of, rope_freqs, sequence_length
from llmjp_ds.model.loss import CausalLMLoss
from llmjp_ds.model.moe import with_router_loss
from llmjp_ds.model.options import ModelOptions
from llmjp_ds.model.shapes import moe_layers, rope_theta


class EmbeddingPipe(Embedding):
    def forward(self, input_ids):
        return super().forward(input_ids)


class DecoderLayerPipe(DecoderLayer):
    """A decoder layer of a stage. An MoE layer's router losses reach the training loss through its output's
    backward (:func:`~llmjp_ds.model.moe.with_router_loss`, the gradient ``router_loss_scale``, which the step runner
    sets); ``moe_index`` is its place among the model's MoE layers (None for a dense layer)."""

    def __init__(self, config, layer_idx, backend, params_dtype=None, tp=None, options=ModelOptions(), ep=None,
                 checkpoint_fn=None):
        super().__init__(config, layer_idx, backend, params_dtype, tp, options, ep, checkpoint_fn)
        self.head_dim, self.theta = head_dim_of(config), rope_theta(config)
        moe = moe_layers(config)
        self.moe_index = moe.index(layer_idx) if layer_idx in moe else None
        self.router_loss_scale = 1.0

    def forward(self, hidden):
        positions = torch.arange(sequence_length(hidden, self.tp), device=hidden.device)
        out = super().forward(hidden, rope_freqs(positions, self.head_dim, self.theta))
        if self.moe_index is not None and self.training:
            out = with_router_loss(out, self.moe.routed.loss, self.router_loss_scale)
        return out


class FinalNormHeadPipe(FinalNormHead):
    pass


class PipelineLoss:
    """``loss_fn`` for the last stage: returns the total loss times ``scale`` (1, or NaN or a spike in a fault
    drill) and ``grad_scale``, keeps the parts of the current step for logging. ``gate(loss)`` (see
    ``parallel/runners.py``) is asked before the step's last micro-batch's loss goes back, with the step's mean loss
    over the stage's data-parallel ranks (``ctx.dp_group``); True returns a NaN loss, so the update is skipped."""

    def __init__(self, z_loss_coeff: float, fused: bool = False, tp=None):
        self.loss_fn = CausalLMLoss(z_loss_coeff, fused, tp)
        self.reset(0)

    def reset(self, micro_batches: int, gate=None, ctx=None, scale: float = 1.0, grad_scale: float = 1.0):
        """A new step of ``micro_batches`` micro-batches (``gate`` and the parallel context ``ctx`` it reduces
        the loss over; the loss ``scale`` and ``grad_scale`` of a fault drill)."""
        self.lm_loss_sum = 0.0
        self.z_loss_sum = 0.0
        self.micro_batches = 0
        self.expected, self.gate, self.ctx, self.skipped = micro_batches, gate, ctx, False
        self.scale, self.grad_scale = scale, grad_scale

    def __call__(self, logits, targets):
        parts = self.loss_fn(logits, targets)
        self.lm_loss_sum = self.lm_loss_sum + parts.lm_loss.detach() * self.scale
        self.z_loss_sum = self.z_loss_sum + parts.z_loss.detach()
        self.micro_batches += 1
        scale = self.scale * self.grad_scale
        if self.gate is not None and self.micro_batches == self.expected and self.gate(self._mean_loss()):
            scale, self.skipped = float("nan"), True
        return parts.loss * scale

    def _mean_loss(self) -> float:
        total = torch.as_tensor(self.lm_loss_sum, dtype=torch.float32, device=self.ctx.device).reshape(1).clone()
        dist.all_reduce(total, group=self.ctx.dp_group)
        return total.item() / (self.micro_batches * self.ctx.dp_size)


def flops_weights(config, seq_len: int) -> list[float]:
    """Training FLOPs per token of each item of :func:`pipeline_layers`: the embedding (a lookup: 0), every decoder
    layer, and the final norm + head (the logits GEMMs). At llmjp3-1.8B the head costs ~3 decoder layers."""
    layer, logits = layer_and_logits_flops_for(config, seq_len)
    return [0.0] + [layer] * config.num_hidden_layers + [logits]


@dataclass(frozen=True)
class StageLayer:
    """One item of the pipeline's layer list: a module class and its arguments (``build()`` makes it)."""

    typename: type
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def build(self) -> torch.nn.Module:
        return self.typename(*self.args, **self.kwargs)


def pipeline_layers(config, backend: str, params_dtype=None, fp8_head: bool = False, tp=None,
                    options: ModelOptions = ModelOptions(), ep=None, checkpoint_fn=None) -> list[StageLayer]:
    """The pipeline's layers in order; ``tp``: the tensor-parallel group every layer is split over (None: whole
    layers); ``ep``: the expert-parallel group an MoE layer's experts are split over (None: every expert);
    ``checkpoint_fn``: what recomputes an MoE block under ``recompute: moe``."""
    return ([StageLayer(EmbeddingPipe, (config, backend, params_dtype, tp))]
            + [StageLayer(DecoderLayerPipe, (config, i, backend, params_dtype, tp, options, ep, checkpoint_fn))
               for i in range(config.num_hidden_layers)]
            + [StageLayer(FinalNormHeadPipe, (config, backend, params_dtype), {"fp8_head": fp8_head, "tp": tp})])
