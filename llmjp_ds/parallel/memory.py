"""Per-GPU memory of a layout, stage by stage: the arithmetic of docs/172b-layout.md as code (pure).

For bf16 with ZeRO-1 and fp32 gradient accumulation (DeepSpeed's ``BF16_Optimizer``; fp32 with ZeRO-1 keeps the
same byte counts): every stage keeps its parameters' bf16 weights and fp32 gradient-accumulation buffer
unsharded over data parallelism (6 bytes per parameter) and its fp32 master weights and Adam moments sharded
over the data-parallel group (12 / DP).

Fused fp32 accumulation: no resident bf16 gradients. With the trainer's default
``parallel.fused_grad_accumulation`` and ``"bf16": {"immediate_grad_update": true}`` (``ds_configs/zero1.json``
and ``pipeline.json``), TE's GEMM weights, the embedding and the LM head accumulate their weight gradient
straight into the fp32 buffer (``main_grad``: ``parallel.deepspeed_internals.fuse_grad_accumulation``,
``model/main_grad.py``); their bf16 ``.grad`` is a placeholder that DeepSpeed's hook drops. Only the RMSNorm
weights (replicated on every TP rank, ``h`` each: tiny) are charged a bf16 gradient as well, 8 bytes. The reason
is a measurement: one TP2 slice of the 172B stage on two H200s (docs/172b-layout.md, "Measured: one TP2 slice
on two H200s (run Q)"; docs/perf-raw/run-q/) allocated at most 59.1 GiB (``max_memory_allocated``, without the
CUDA context) where 8 bytes per parameter and a bucket at DP = 1 predicted 68.0 GiB; this model predicts 60.0 GiB
including the 1.5 GiB context allowance.

Tensor parallelism ``t`` (TE's column/row-parallel layers; the embedding and the LM head vocab-parallel) divides
every weight matrix by ``t``: QKV, the attention output projection, fc1, fc2, the embedding's and the head's
rows. The RMSNorm weights (two per layer and the final one, ``h`` each) stay whole on every TP rank. A GPU's
parameters, and so all of its per-parameter bytes, are its TP shard of its stage's.

Activations per layer per micro-batch follow Korthikanti et al. (2022), bf16, in bytes of ``sbh``:

- ``none`` and ``selective``: ``34 sbh / t`` with sequence parallelism (``(10 + 24 / t) sbh`` without it). TE's
  fused (flash) attention never stores the ``5 a s^2 b`` scores that selective recompute exists to drop, and
  recomputing the attention core frees only what flash attention keeps (Q, K, V feed the core's checkpoint
  anyway; its softmax statistics are ``a s b`` fp32, about 1/60 of ``sbh`` here): selective keeps the same 34.
- ``full``: ``2 sbh / t`` (the layer's input, a sequence shard under SP), plus one layer recomputed in backward
  as a transient.

A mixture of experts (``shape.num_experts``; every layer but ``shape.dense_layers``): an MoE layer holds its
attention, its router (``E h``) and its experts (``3 h f`` each, ``f`` the expert width). With expert parallelism
``e`` a GPU holds ``E / e`` experts of each MoE layer, and DeepSpeed shards their fp32 master weights and moments
over the expert-data-parallel group (``DP / e`` ranks) where the dense parameters' go over all ``DP``. Its
activations replace the dense MLP's ``9.5`` tensors of the 34 by each token's ``k`` routed rows: the permuted
input and the experts' output (``2k``), fc1's and SwiGLU's outputs (``3 k f / h``), and the router's fp32 logits
and probabilities (``4 E / h``). Under ``recompute: moe`` an MoE layer keeps its attention's share and the MoE
block's input (``17 - 9.5 + 1``), and one block's tensors are the backward's transient.

Each stage also holds its output ``2 sbh / t`` (sequence-sharded under SP) per micro-batch; under 1F1B stage *i*
holds ``min(PP - i, GAS)`` micro-batches. The last stage also holds one micro-batch's logits (bf16, their fp32
copy, fp32 and bf16 gradients: 12 bytes per logit), ``V / t`` of the vocabulary per TP rank. Every GPU gets an
allowance for transient memory: the layer recomputed in backward (full), the recomputed attention output
(selective), the all-gathered ``[s, b, h]`` input of a column-parallel GEMM (SP), the fp32 all-reduce bucket
(only with data parallelism: DeepSpeed buckets only for a data-parallel all-reduce, so with DP = 1 it is never
allocated), CUDA context and NCCL.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmjp_ds.config import RECOMPUTE_MODES
from llmjp_ds.model.flops import parameter_count

GIB = 2**30
ALLREDUCE_BUCKET_BYTES = 500_000_000 * 4  # the pipeline engine's fp32 all-reduce bucket (MEMORY_OPT_ALLREDUCE_SIZE)
CONTEXT_GIB = 1.5  # CUDA context and NCCL
UNSHARDED_BYTES = 6  # bf16 weights 2 + fp32 accumulation 4 (fused fp32 accumulation: no resident bf16 gradients)
NORM_UNSHARDED_BYTES = 8  # the RMSNorm weights: bf16 weights 2 + bf16 gradients 2 + fp32 accumulation 4
SHARDED_BYTES = 12  # fp32 master weights 4 + Adam m 4 + v 4
LOGIT_BYTES = 12  # bf16 logits 2 + fp32 copy 4 + fp32 gradient 4 + bf16 gradient 2


@dataclass(frozen=True)
class StageMemory:
    stage: int
    layers: int
    params: int  # this GPU's: its TP shard of the stage's parameters
    in_flight: int
    weights_grads_accum: float  # GiB: bf16 weights + fp32 gradient accumulation (+ the norms' bf16 gradients)
    optimizer: float
    activations: float
    logits: float
    transient: float  # the layer recomputed in backward, the all-reduce bucket (DP > 1), CUDA context and NCCL
    tensor: int = 1
    recompute: str = "full"
    expert: int = 1

    @property
    def total(self) -> float:
        return self.weights_grads_accum + self.optimizer + self.activations + self.logits + self.transient


def _split(n: int, tensor: int) -> int:
    """One TP rank's share of ``n`` (rounded up where ``tensor`` does not divide it)."""
    return -(-n // tensor)


def _is_moe(shape, index: int) -> bool:
    return bool(shape.num_experts) and index not in shape.dense_layers


def layer_params(shape, tensor: int = 1, index: int = 0, expert: int = 1) -> int:
    """Parameters of decoder layer ``index`` of a :class:`~llmjp_ds.model.shapes.ModelShape` on one TP rank (all
    of them for ``tensor == 1``), as :func:`~llmjp_ds.model.flops.parameter_count` counts a layer: its share of the
    four projections and the MLP, and both RMSNorm weights whole (and qk-norm's two per-head weights). An MoE
    layer's MLP is its router and its ``E / expert`` experts (never split over TP, which an MoE model refuses)."""
    h, d = shape.hidden_size, shape.head_dim or shape.hidden_size // shape.num_attention_heads
    moe = _is_moe(shape, index)
    whole = parameter_count(hidden_size=h, num_layers=1, num_attention_heads=shape.num_attention_heads,
                            num_key_value_heads=shape.num_key_value_heads, intermediate_size=shape.ffn_hidden_size,
                            vocab_size=0, head_dim=d, qk_norm=shape.qk_norm, moe_layers=int(moe),
                            num_experts=shape.num_experts, moe_ffn_hidden_size=shape.moe_ffn_hidden_size or 0,
                            )["non_embedding"] - h  # the final norm is the last stage's
    if moe:
        return whole - expert_layer_params(shape) + expert_layer_params(shape, expert)
    norms = 2 * h + (2 * d if shape.qk_norm else 0)
    return _split(whole - norms, tensor) + norms


def expert_layer_params(shape, expert: int = 1) -> int:
    """One GPU's expert parameters of one MoE layer: ``E / expert`` experts of ``3 h f`` each."""
    return shape.num_experts // expert * 3 * shape.hidden_size * shape.moe_ffn_hidden_size


def _moe_extra_tensors(shape) -> float:
    """An MoE layer's activations beyond a dense layer's, in bf16 ``[s, b, h]`` tensors (the module's docstring)."""
    h, k, f, e = shape.hidden_size, shape.experts_per_token, shape.moe_ffn_hidden_size, shape.num_experts
    return 2 * k + 3 * k * f / h + 4 * e / h - 9.5


def _activation_tensors(recompute: str, tensor: int, sequence_parallel: bool) -> tuple[float, float, float]:
    """Per layer kept for backward, the stage output, and the backward transient, in bf16 ``[s, b, h]``
    tensors (1 = ``2 sbh`` bytes): Korthikanti et al.'s 34 (selective, or no recompute with flash attention)."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute {recompute!r}: one of {', '.join(RECOMPUTE_MODES)}")
    t = tensor
    layer = 17 / t if sequence_parallel or t == 1 else 5 + 12 / t  # 34 sbh / t, or (10 + 24 / t) sbh without SP
    shard = 1 / t if sequence_parallel else 1  # the layer input and the stage output: sequence-sharded under SP
    gathered = 1 if sequence_parallel and t > 1 else 0  # SP's all-gathered input of a column-parallel GEMM
    if recompute == "full":
        return shard, shard, layer + gathered
    if recompute == "selective":
        return layer, shard, 1 / t + gathered  # the attention output [s, b, h / t], recomputed in backward
    return layer, shard, gathered  # none, and moe (an MoE layer's share: stage_memory)


def stage_memory(shape, stage: int, layers: int, pipeline: int, data: int, micro_batch: int, seq_len: int,
                 gas: int, recompute: str = "none", tensor: int = 1,
                 sequence_parallel: bool = True, first: int = 0, expert: int = 1) -> StageMemory:
    """Memory of one GPU of pipeline stage ``stage`` (of ``pipeline``) holding ``layers`` decoder layers from
    layer ``first`` on, with tensor parallelism ``tensor`` (sequence-parallel unless ``sequence_parallel`` is
    false) and expert parallelism ``expert``; stage 0 also holds the embedding, the last stage the final norm and
    the LM head (both vocab-parallel)."""
    h, vocab = shape.hidden_size, shape.vocab_size
    last = stage == pipeline - 1
    indices = range(first, first + layers)
    moe = sum(_is_moe(shape, i) for i in indices)
    embedding = _split(vocab * h, tensor)
    params = sum(layer_params(shape, tensor, i, expert) for i in indices) + (embedding if stage == 0 else 0) + (
        embedding + h if last else 0)
    experts = moe * expert_layer_params(shape, expert) if moe else 0
    head_dim = shape.head_dim or h // shape.num_attention_heads
    # RMSNorm weights (and qk-norm's): whole on every TP rank, with a bf16 gradient
    norms = layers * (2 * h + (2 * head_dim if shape.qk_norm else 0)) + (h if last else 0)
    sbh = seq_len * micro_batch * h * 2  # bytes of one bf16 [s, b, h] tensor
    per_layer, output, transient = _activation_tensors(recompute, tensor, sequence_parallel)
    extra = _moe_extra_tensors(shape) if moe else 0.0
    if recompute == "moe" and moe:  # an MoE layer keeps its block's input, and one block is recomputed
        kept, transient = layers * per_layer + moe * (1 - 9.5), transient + 9.5 + extra
    else:
        kept = layers * per_layer + (moe * extra if recompute != "full" else 0)
        transient += extra if recompute == "full" else 0  # the MoE layer recomputed in backward
    in_flight = min(pipeline - stage, gas)
    activations = in_flight * (kept + output) * sbh
    logits = LOGIT_BYTES * seq_len * micro_batch * _split(vocab, tensor) if last else 0
    bucket = ALLREDUCE_BUCKET_BYTES if data > 1 else 0  # DeepSpeed buckets only a data-parallel all-reduce
    sharded = (params - experts) / data + experts / max(1, data // expert)  # experts over the expert-DP group
    return StageMemory(stage=stage, layers=layers, params=params, in_flight=in_flight,
                       weights_grads_accum=(UNSHARDED_BYTES * (params - norms)
                                            + NORM_UNSHARDED_BYTES * norms) / GIB,
                       optimizer=SHARDED_BYTES * sharded / GIB, activations=activations / GIB,
                       logits=logits / GIB,
                       transient=(transient * sbh + bucket) / GIB + CONTEXT_GIB,
                       tensor=tensor, recompute=recompute, expert=expert if moe else 1)


def layout_memory(shape, stage_layers: list[int], data: int, micro_batch: int, seq_len: int, gas: int,
                  recompute: str = "none", tensor: int = 1, sequence_parallel: bool = True,
                  expert: int = 1) -> list[StageMemory]:
    """Every stage's memory (one GPU of each), for the decoder layers per stage in ``stage_layers``."""
    firsts = [sum(stage_layers[:i]) for i in range(len(stage_layers))]
    return [stage_memory(shape, i, n, len(stage_layers), data, micro_batch, seq_len, gas, recompute, tensor,
                         sequence_parallel, firsts[i], expert)
            for i, n in enumerate(stage_layers)]


def stage_layers(bounds: list[int], num_layers: int) -> list[int]:
    """Decoder layers per stage from the pipeline's cut points over its layer specs (the embedding is spec 0,
    the head spec ``num_layers + 1``; ``bounds`` as ``parallel.pipeline.stage_bounds`` returns them)."""
    return [len([i for i in range(lo, hi) if 1 <= i <= num_layers]) for lo, hi in zip(bounds, bounds[1:])]


def describe(stage: StageMemory, capacity_gib: float | None = None) -> str:
    """One line for preflight: the busiest stage's estimate and what it is made of."""
    shard = (f", TP{stage.tensor} shard" if stage.tensor > 1 else "") + (
        f", 1/{stage.expert} of the experts" if stage.expert > 1 else "")
    parts = (f"weights+fp32 grad accum {stage.weights_grads_accum:.1f} + master+Adam {stage.optimizer:.1f} + "
             f"activations {stage.activations:.1f} ({stage.in_flight} micro-batches in flight, "
             f"recompute {stage.recompute}) + "
             + (f"logits {stage.logits:.1f} + " if stage.logits else "") + f"transient {stage.transient:.1f}")
    fits = "" if capacity_gib is None else (
        f"; fits {capacity_gib:.1f} GiB" if stage.total <= capacity_gib else f"; does NOT fit {capacity_gib:.1f} GiB")
    return f"busiest GPU: stage {stage.stage} ({stage.layers} layers{shard}), ~{stage.total:.1f} GiB = {parts}{fits}"


def snapshot_gib(stage: StageMemory, data: int, dtype_bytes: int, writes_model_states: bool = True) -> float:
    """Host memory of one GPU's checkpoint snapshot (``checkpoint.async_save``): its weights in the run's dtype
    if it writes the model states (DeepSpeed: data-parallel rank 0 of each stage and TP rank), and its ZeRO-1
    shard of fp32 master weights and Adam moments (12 / DP bytes per parameter)."""
    weights = dtype_bytes * stage.params if writes_model_states else 0
    return (weights + SHARDED_BYTES * stage.params / data) / GIB


def node_snapshot_gib(stage: StageMemory, data: int, dtype_bytes: int, ranks_per_node: int) -> float:
    """Host memory of the checkpoint snapshots of the node that holds the most: its ranks are consecutive (TP
    innermost, then data), so it holds ``ranks_per_node / tensor`` data ranks of a stage, and the TP group of
    data rank 0 (the model-state writers) of each stage it touches."""
    t = stage.tensor
    writers = t * max(1, ranks_per_node // (t * data))
    return writers * snapshot_gib(stage, data, dtype_bytes) + (ranks_per_node - writers) * snapshot_gib(
        stage, data, dtype_bytes, writes_model_states=False)
