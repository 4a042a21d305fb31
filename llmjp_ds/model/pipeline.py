"""The pipeline-parallel split, visible in one place: embedding | decoder layers | final norm + head.

The pipeline's layers are the same classes the HF model is made of, listed as :class:`StageLayer`s (a class and
its arguments, built only on the stage that holds it), with each one's training FLOPs for the partition. Plain
data and PyTorch modules: ``parallel/pipeline.py`` turns them into DeepSpeed's ``LayerSpec``s and the
``PipelineModule``. Activations travel between stages as one ``[b, s, h]`` tensor; RoPE angles are recomputed
per layer from the sequence length (cheap, and nothing extra crosses a stage boundary).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmjp_ds.model.flops import layer_and_logits_flops_for
from llmjp_ds.model.llama import DecoderLayer, Embedding, FinalNormHead, head_dim_of, rope_freqs, sequence_length
from llmjp_ds.model.loss import CausalLMLoss
from llmjp_ds.model.shapes import rope_theta


class EmbeddingPipe(Embedding):
    def forward(self, input_ids):
        return super().forward(input_ids)


class DecoderLayerPipe(DecoderLayer):
    def __init__(self, config, layer_idx, backend, params_dtype=None, tp=None, recompute_core=False):
        super().__init__(config, layer_idx, backend, params_dtype, tp, recompute_core)
        self.head_dim, self.theta = head_dim_of(config), rope_theta(config)

    def forward(self, hidden):
        positions = torch.arange(sequence_length(hidden, self.tp), device=hidden.device)
        return super().forward(hidden, rope_freqs(positions, self.head_dim, self.theta))


class FinalNormHeadPipe(FinalNormHead):
    pass


class PipelineLoss:
    """``loss_fn`` for the last stage: returns the total loss times ``scale`` (1, or NaN in a fault drill), keeps
    the parts of the current step for logging."""

    def __init__(self, z_loss_coeff: float, fused: bool = False, tp=None):
        self.loss_fn = CausalLMLoss(z_loss_coeff, fused, tp)
        self.scale = 1.0
        self.reset()

    def reset(self):
        self.lm_loss_sum = 0.0
        self.z_loss_sum = 0.0
        self.micro_batches = 0

    def __call__(self, logits, targets):
        parts = self.loss_fn(logits, targets)
        self.lm_loss_sum = self.lm_loss_sum + parts.lm_loss.detach() * self.scale
        self.z_loss_sum = self.z_loss_sum + parts.z_loss.detach()
        self.micro_batches += 1
        return parts.loss * self.scale


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
                    recompute_core: bool = False) -> list[StageLayer]:
    """The pipeline's layers in order; ``tp``: the tensor-parallel group every layer is split over (None: whole
    layers)."""
    return ([StageLayer(EmbeddingPipe, (config, backend, params_dtype, tp))]
            + [StageLayer(DecoderLayerPipe, (config, i, backend, params_dtype, tp, recompute_core))
               for i in range(config.num_hidden_layers)]
            + [StageLayer(FinalNormHeadPipe, (config, backend, params_dtype), {"fp8_head": fp8_head, "tp": tp})])
