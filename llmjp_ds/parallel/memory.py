"""Per-GPU memory of a layout, stage by stage: the arithmetic of docs/172b-layout.md as code (pure).

For bf16 with ZeRO-1 and fp32 gradient accumulation (DeepSpeed's ``BF16_Optimizer``; fp32 with ZeRO-1 keeps the
same byte counts): every stage keeps its parameters' bf16 weights, bf16 gradients and fp32 accumulation buffer
unsharded (8 bytes per parameter) and its fp32 master weights and Adam moments sharded over the data-parallel
group (12 / DP). Activations follow Korthikanti et al. (2022) per micro-batch: ``34 sbh`` per layer without
full recompute (TE's fused attention never stores the s^2 scores) and ``2 sbh`` (the layer's input) with it, plus
the stage's output ``2 sbh``; under 1F1B stage *i* holds ``min(PP - i, GAS)`` micro-batches. The last stage
also holds one micro-batch's logits (bf16, their fp32 copy, fp32 and bf16 gradients: 12 bytes per logit), and
every GPU an allowance for transient memory (one recomputed layer, the fp32 all-reduce bucket, CUDA context and
NCCL).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
ALLREDUCE_BUCKET_BYTES = 500_000_000 * 4  # the pipeline engine's fp32 all-reduce bucket (MEMORY_OPT_ALLREDUCE_SIZE)
CONTEXT_GIB = 1.5  # CUDA context and NCCL
UNSHARDED_BYTES = 8  # bf16 weights 2 + bf16 gradients 2 + fp32 accumulation 4
SHARDED_BYTES = 12  # fp32 master weights 4 + Adam m 4 + v 4
LOGIT_BYTES = 12  # bf16 logits 2 + fp32 copy 4 + fp32 gradient 4 + bf16 gradient 2


@dataclass(frozen=True)
class StageMemory:
    stage: int
    layers: int
    params: int
    in_flight: int
    weights_grads_accum: float  # GiB
    optimizer: float
    activations: float
    logits: float
    transient: float  # the layer recomputed in backward, the all-reduce bucket, CUDA context and NCCL

    @property
    def total(self) -> float:
        return self.weights_grads_accum + self.optimizer + self.activations + self.logits + self.transient


def layer_params(shape) -> int:
    """Parameters of one decoder layer of a :class:`~llmjp_ds.model.shapes.ModelShape`."""
    h, d = shape.hidden_size, shape.hidden_size // shape.num_attention_heads
    attention = 2 * h * (shape.num_attention_heads * d) + 2 * h * (shape.num_key_value_heads * d)
    return attention + 3 * h * shape.ffn_hidden_size + 2 * h


def stage_memory(shape, stage: int, layers: int, pipeline: int, data: int, micro_batch: int, seq_len: int,
                 gas: int, full_recompute: bool) -> StageMemory:
    """Memory of pipeline stage ``stage`` (of ``pipeline``) holding ``layers`` decoder layers; stage 0 also holds
    the embedding, the last stage the final norm and the LM head."""
    h, vocab = shape.hidden_size, shape.vocab_size
    last = stage == pipeline - 1
    params = layers * layer_params(shape) + (vocab * h if stage == 0 else 0) + ((vocab + 1) * h if last else 0)
    sbh = seq_len * micro_batch * h * 2  # bytes of one bf16 [s, b, h] tensor
    per_layer = 1 if full_recompute else 17  # 2 sbh or 34 sbh, in bf16 [s, b, h] tensors
    in_flight = min(pipeline - stage, gas)
    activations = in_flight * (layers * per_layer + 1) * sbh
    logits = LOGIT_BYTES * seq_len * micro_batch * vocab if last else 0
    recomputed = 17 * sbh if full_recompute else 0
    return StageMemory(stage=stage, layers=layers, params=params, in_flight=in_flight,
                       weights_grads_accum=UNSHARDED_BYTES * params / GIB,
                       optimizer=SHARDED_BYTES * params / data / GIB, activations=activations / GIB,
                       logits=logits / GIB, transient=(recomputed + ALLREDUCE_BUCKET_BYTES) / GIB + CONTEXT_GIB)


def layout_memory(shape, stage_layers: list[int], data: int, micro_batch: int, seq_len: int, gas: int,
                  full_recompute: bool) -> list[StageMemory]:
    """Every stage's memory, for the decoder layers per stage in ``stage_layers``."""
    return [stage_memory(shape, i, n, len(stage_layers), data, micro_batch, seq_len, gas, full_recompute)
            for i, n in enumerate(stage_layers)]


def stage_layers(bounds: list[int], num_layers: int) -> list[int]:
    """Decoder layers per stage from the pipeline's cut points over its layer specs (the embedding is spec 0,
    the head spec ``num_layers + 1``; ``bounds`` as ``model.pipeline.stage_bounds`` returns them)."""
    return [len([i for i in range(lo, hi) if 1 <= i <= num_layers]) for lo, hi in zip(bounds, bounds[1:])]


def describe(stage: StageMemory, capacity_gib: float | None = None) -> str:
    """One line for preflight: the busiest stage's estimate and what it is made of."""
    parts = (f"weights+grads+fp32 accum {stage.weights_grads_accum:.1f} + master+Adam {stage.optimizer:.1f} + "
             f"activations {stage.activations:.1f} ({stage.in_flight} micro-batches in flight) + "
             + (f"logits {stage.logits:.1f} + " if stage.logits else "") + f"transient {stage.transient:.1f}")
    fits = "" if capacity_gib is None else (
        f"; fits {capacity_gib:.1f} GiB" if stage.total <= capacity_gib else f"; does NOT fit {capacity_gib:.1f} GiB")
    return f"busiest GPU: stage {stage.stage} ({stage.layers} layers), ~{stage.total:.1f} GiB = {parts}{fits}"
