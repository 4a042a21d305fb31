"""The pipeline-parallel split, visible in one place: embedding | decoder layers | final norm + head.

The stages are DeepSpeed ``LayerSpec``s of the same classes the HF model is made of, so each rank builds only
its own layers. Activations travel between stages as one ``[b, s, h]`` tensor; RoPE angles are recomputed per
layer from the sequence length (cheap, and nothing extra crosses a stage boundary).
"""

from __future__ import annotations

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
    """Training FLOPs per token of each item of :func:`layer_specs`: the embedding (a lookup: 0), every decoder
    layer, and the final norm + head (the logits GEMMs). At llmjp3-1.8B the head costs ~3 decoder layers."""
    layer, logits = layer_and_logits_flops_for(config, seq_len)
    return [0.0] + [layer] * config.num_hidden_layers + [logits]


def stage_bounds(weights: list[float], num_stages: int) -> list[int]:
    """Where the stages start in the layer specs (``num_stages + 1`` bounds): DeepSpeed's linear partition,
    which makes the stages' summed weights as even as the cuts allow."""
    from deepspeed.runtime.utils import partition_balanced

    return [int(b) for b in partition_balanced(weights=weights, num_parts=num_stages)]


def pipeline_module_class():
    """``PipelineModule`` whose forward (one micro-batch on this stage) runs inside ``micro_batch_context()``
    (the precision schedule's per-micro-batch context, handed over once at setup), and which knows one more
    ``partition_method``:
    ``flops`` cuts the layers where each stage's training FLOPs (``partition_weights``, from
    :func:`flops_weights`) are most even, so the last stage's head counts; DeepSpeed's ``type:`` methods
    count decoder layers only."""
    import contextlib

    from deepspeed.pipe import PipelineModule

    class PrecisionPipelineModule(PipelineModule):
        micro_batch_context = staticmethod(contextlib.nullcontext)

        def __init__(self, *args, partition_weights=None, **kwargs):
            object.__setattr__(self, "_partition_weights", partition_weights)
            super().__init__(*args, **kwargs)

        def _partition_layers(self, method="uniform"):
            if method.lower() != "flops":
                return super()._partition_layers(method)
            if self._partition_weights is None or len(self._partition_weights) != len(self._layer_specs):
                raise ValueError("partition_method 'flops' needs partition_weights, one per layer spec")
            self.parts = stage_bounds(self._partition_weights, self.num_stages)
            stage = self._topo.get_coord(self.global_rank).pipe
            if self.global_rank == 0:
                print(f"[llmjp-ds] pipeline stages by training FLOPs: layer specs {self.parts}", flush=True)
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

        def forward(self, forward_input):
            with self.micro_batch_context():
                return super().forward(forward_input)

    return PrecisionPipelineModule


def layer_specs(config, backend: str, params_dtype=None, fp8_head: bool = False, tp=None,
                recompute_core: bool = False) -> list:
    """The stages' layers; ``tp``: the tensor-parallel group every layer is split over (None: whole layers)."""
    from deepspeed.pipe import LayerSpec

    return ([LayerSpec(EmbeddingPipe, config, backend, params_dtype, tp)]
            + [LayerSpec(DecoderLayerPipe, config, i, backend, params_dtype, tp, recompute_core)
               for i in range(config.num_hidden_layers)]
            + [LayerSpec(FinalNormHeadPipe, config, backend, params_dtype, fp8_head=fp8_head, tp=tp)])
