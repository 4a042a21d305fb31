"""``parallel.memory``: the per-stage memory of a layout, pinned to the tables of docs/172b-layout.md (llmjp3-172b,
micro batch 1, seq 4096, global batch 1728 on 512 GPUs, bf16 + ZeRO-1; TP with sequence parallelism), and to one
recorded measurement: the TP2 slice on two H200s (run Q, docs/172b-layout.md §9)."""

from __future__ import annotations

import dataclasses

import pytest

from llmjp_ds.model.shapes import get_shape, resolve_shape
from llmjp_ds.parallel.memory import (
    ALLREDUCE_BUCKET_BYTES,
    CONTEXT_GIB,
    GIB,
    layer_params,
    layout_memory,
    stage_layers,
)

SHAPE = get_shape("llmjp3-172b")
H = 12288


def layers_of(pp: int) -> list[int]:
    from llmjp_ds.model import model_config
    from llmjp_ds.model.pipeline_layers import flops_weights
    from llmjp_ds.parallel.stages import stage_bounds

    return stage_layers(stage_bounds(flops_weights(model_config("llmjp3-172b"), 4096), pp), 96)


def layout(pp: int, recompute: str = "full", tp: int = 1, sequence_parallel: bool = True):
    dp = 512 // (pp * tp)
    return layout_memory(SHAPE, layers_of(pp), dp, 1, 4096, 1728 // dp, recompute, tp, sequence_parallel)


def busiest(stages):
    return max(stages, key=lambda s: s.total)


def projected_seconds(tp: int, pp: int, recompute: str) -> float:
    """§4's projection: 6 N tokens at 400 TFLOP/s per GPU, x recompute (selective +2 %, full +33 %), plus TP
    communication (10 all-gathers/reduce-scatters of one bf16 [s, b, h] per layer and micro-batch, 14 with full
    recompute, at 300 GB/s bus bandwidth, not overlapped), x the 1F1B bubble (GAS + PP - 1) / GAS."""
    dp = 512 // (pp * tp)
    gas = 1728 // dp
    factor = {"none": 1, "selective": 1.02, "full": 4 / 3}[recompute]
    compute = 6 * 172_400_848_896 * 1728 * 4096 / 512 / 400e12 * factor
    collectives = gas * (96 // pp) * (14 if recompute == "full" else 10) if tp > 1 else 0
    comm = collectives * 4096 * H * 2 * (tp - 1) / tp / 300e9
    return (compute + comm) * (gas + pp - 1) / gas


def test_one_decoder_layer_has_the_documented_parameters():
    assert layer_params(SHAPE) == 1_770_283_008


# §1: one decoder layer on one TP rank: the projections and the MLP split, both RMSNorm weights whole
@pytest.mark.parametrize("tp,params", [(1, 1_770_283_008), (2, 885_153_792), (4, 442_589_184),
                                       (8, 221_306_880)])
def test_one_decoder_layer_per_tensor_parallel_rank(tp, params):
    assert layer_params(SHAPE, tp) == params
    assert layer_params(SHAPE, tp) - 2 * H == (layer_params(SHAPE) - 2 * H) // tp  # norms replicated


# §1: parameters of stage 0, a middle stage and the last stage (whole stages: no TP)
@pytest.mark.parametrize("pp,first,middle,last", [
    (8, 22_470_230_016, 21_243_396_096, 22_470_242_304),
    (16, 11_848_531_968, 10_621_698_048, 11_848_544_256),
    (32, 6_537_682_944, 5_310_849_024, 6_537_695_232),
    (64, 4_767_399_936, 3_540_566_016, 2_997_129_216),
])
def test_parameters_per_stage(pp, first, middle, last):
    stages = layout(pp)
    assert (stages[0].params, stages[1].params, stages[-1].params) == (first, middle, last)


# §1: one GPU of a PP16 stage under TP: the embedding (stage 0) and the LM head (last) vocab-parallel, the final
# norm whole
@pytest.mark.parametrize("tp,first,middle,last", [
    (2, 5_924_339_712, 5_310_922_752, 5_924_352_000),
    (4, 2_962_243_584, 2_655_535_104, 2_962_255_872),
    (8, 1_481_195_520, 1_327_841_280, 1_481_207_808),
])
def test_parameters_per_gpu_under_tensor_parallelism(tp, first, middle, last):
    stages = layout(16, "selective", tp)
    assert (stages[0].params, stages[1].params, stages[-1].params) == (first, middle, last)
    assert stages[0].params - stages[1].params == 99840 * H // tp  # the embedding's rows
    assert stages[-1].params - stages[1].params == 99840 * H // tp + H  # the head's rows + the final norm


# §3: stage 0's activations in flight, full and selective (= none with flash attention) recompute, GiB
@pytest.mark.parametrize("pp,full,selective", [(8, 9.8, 153.8), (16, 10.5, 154.5), (32, 12.0, 156.0),
                                                (64, 18.0, 210.0)])
def test_stage_zero_activations(pp, full, selective):
    assert round(layout(pp)[0].activations, 1) == full
    assert round(layout(pp, "selective")[0].activations, 1) == selective
    assert layout(pp, "none")[0].activations == layout(pp, "selective")[0].activations


# §3: under TP4 with SP everything in flight is a quarter; without SP only 24 of the 34 sbh split
def test_tensor_parallel_activations():
    assert round(layout(16, "selective", 4)[0].activations, 1) == 38.6  # 16 x (6 x 34 + 2) sbh / 4
    assert round(layout(16, "full", 4)[0].activations, 1) == 2.6  # 16 x 7 x 2 sbh / 4
    assert round(layout(16, "selective", 4, sequence_parallel=False)[0].activations, 1) == 73.5  # 16 x (6 x 16 + 2) sbh


def test_tensor_parallel_logits_are_vocab_parallel():
    assert round(layout(16, "selective", 4)[-1].logits, 2) == 1.14  # 12 B x 4096 x 99840 / 4
    assert layout(16, "selective", 4)[-1].logits * 4 == layout(16, "selective", 1)[-1].logits


# §4: the candidate layouts without TP: the busiest GPU (stage 0) and its parts, GiB
@pytest.mark.parametrize("pp,unsharded,sharded,total", [(8, 125.6, 3.9, 144.2), (16, 66.2, 4.1, 85.8),
                                                        (32, 36.5, 4.6, 58.1), (64, 26.6, 6.7, 56.3)])
def test_busiest_gpu_of_each_candidate(pp, unsharded, sharded, total):
    stage = busiest(layout(pp))
    assert stage.stage == 0
    assert (round(stage.weights_grads_accum, 1), round(stage.optimizer, 1), round(stage.total, 1)) == \
        (unsharded, sharded, total)


# §4: TP x PP on 512 GPUs: the busiest GPU with selective and with full recompute, and the
# projected seconds per step of the fastest recompute mode that fits 79.6 GiB (None: neither fits)
@pytest.mark.parametrize("tp,pp,selective,full,seconds", [
    (1, 8, 286.7, 144.2, None), (1, 16, 228.3, 85.8, None), (1, 32, 200.6, 58.1, 61.3),
    (2, 8, 147.1, 75.8, 55.6), (2, 16, 118.0, 46.7, 56.0), (2, 32, 104.3, 33.1, 56.2),
    (4, 8, 77.2, 41.6, 42.3), (4, 16, 62.8, 27.2, 42.5), (4, 32, 56.2, 20.6, 42.6),
    (8, 8, 42.3, 24.5, 45.5), (8, 16, 35.2, 17.4, 45.6), (8, 32, 32.1, 14.3, 45.7),
])
def test_tensor_and_pipeline_candidates(tp, pp, selective, full, seconds):
    sel, ful = busiest(layout(pp, "selective", tp)), busiest(layout(pp, "full", tp))
    assert sel.stage == ful.stage == 0
    assert (round(sel.total, 1), round(ful.total, 1)) == (selective, full)
    # no recompute keeps as much; selective adds only the recomputed attention output, [s, b, h / t] in bf16
    assert sel.total - busiest(layout(pp, "none", tp)).total == pytest.approx(96 / 1024 / tp)
    fastest = next((mode for mode, stage in (("selective", sel), ("full", ful)) if stage.total <= 79.6), None)
    assert (fastest and round(projected_seconds(tp, pp, fastest), 1)) == seconds


def test_the_previous_layout_stage_by_stage():
    """§5: PP 32 x DP 16: stage 0 58.1 GiB, stage 1 50.0 GiB, the last stage (with the logits) 51.0 GiB."""
    stages = layout(32)
    assert [round(stages[i].total, 1) for i in (0, 1, 31)] == [58.1, 50.0, 51.0]
    assert round(stages[31].logits, 1) == 4.6 and stages[31].in_flight == 1 and stages[0].in_flight == 32


def test_the_recommended_layout_stage_by_stage():
    """§5: TP4 x PP16 x DP8, selective: stage 0 62.8 GiB, stage 1 58.2 GiB, the last stage 27.7 GiB."""
    stages = layout(16, "selective", 4)
    first = stages[0]
    assert (round(first.weights_grads_accum, 1), round(first.optimizer, 1), round(first.activations, 1),
            round(first.transient, 1), round(first.total, 1)) == (16.6, 4.1, 38.6, 3.5, 62.8)
    assert [round(stages[i].total, 1) for i in (0, 1, 15)] == [62.8, 58.2, 27.7]
    assert stages[0].in_flight == 16 and stages[15].in_flight == 1
    # LLM-jp's Megatron layout, the same split: 2 + 4 + 12 / 8 bytes per parameter (distributed optimizer): the
    # same bytes as ours; ours is the fp32 all-reduce bucket (1.9 GiB) more: 60.9 GiB against 62.8
    assert round(first.params * (2 + 4 + 12 / 8) / GIB, 1) == 20.7
    assert round(first.total - ALLREDUCE_BUCKET_BYTES / GIB, 1) == 60.9
    # §5: 79.6 GiB leaves 16.8 GiB; the FP8 weight cache (up to 2 B per parameter) fits in it
    assert round(79.6 - first.total, 1) == 16.8 and round(2 * first.params / GIB, 1) == 5.5
    # §4: TP4 x PP8 fits on paper but leaves 2.4 GiB, less than its FP8 weight cache (10.5 GiB)
    pp8 = layout(8, "selective", 4)[0]
    assert round(79.6 - pp8.total, 1) == 2.4 and round(2 * pp8.params / GIB, 1) == 10.5


def test_bytes_per_parameter():
    """§2: 6 unsharded bytes per parameter (bf16 weights + fp32 accumulation; fused fp32 accumulation leaves no
    resident bf16 gradient), 8 for the RMSNorm weights (bf16 gradient kept), 12 / DP for master weights + Adam."""
    stage = layout(16, "selective", 4)[1]  # 6 layers, no embedding or head
    norms = 6 * 2 * H
    assert stage.weights_grads_accum * GIB == 6 * (stage.params - norms) + 8 * norms
    assert stage.optimizer * GIB == pytest.approx(12 * stage.params / 8)


def test_the_allreduce_bucket_counts_only_with_data_parallelism():
    """DeepSpeed buckets only a data-parallel all-reduce: with DP = 1 the fp32 bucket is never allocated."""
    one, two = (layout_memory(SHAPE, [6, 6], dp, 1, 4096, 8, "selective", 4)[0] for dp in (1, 2))
    assert (two.transient - one.transient) * GIB == pytest.approx(ALLREDUCE_BUCKET_BYTES)


def test_recompute_modes_are_checked():
    with pytest.raises(ValueError, match="recompute"):
        layout(32, "partial")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sets,config,memory", [
    ([], "gradient accumulation", "busiest GPU: stage "),
    (["parallel.tensor_parallel=1", "parallel.pipeline_stages=32", "model.recompute=full"],
     "PP32 x DP16, ZeRO-1, gradient accumulation 108",
     ("busiest GPU: stage 0 (3 layers), ~58.1 GiB = weights+fp32 grad accum 36.5 + master+Adam 4.6 + "
      "activations 12.0 (32 micro-batches in flight, recompute full) + transient 5.0")),
    (["parallel.tensor_parallel=4", "parallel.pipeline_stages=16", "model.recompute=selective"],
     "DP8, ZeRO-1, gradient accumulation 216",
     ("busiest GPU: stage 0 (6 layers, TP4 shard), ~62.8 GiB = weights+fp32 grad accum 16.6 + master+Adam 4.1 + "
      "activations 38.6 (16 micro-batches in flight, recompute selective) + transient 3.5")),
])
def test_preflight_prints_the_busiest_gpu_of_the_configured_layout(sets, config, memory):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "llmjp_ds.cli", "preflight", "--hostfile", "hostfiles/h100",
                          "--preset", "llmjp3-172b", *[a for s in sets for a in ("--set", s)]],
                         cwd=repo, capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if not line.startswith("[")]  # DeepSpeed's own log lines
    assert config in lines[0]
    assert lines[1].startswith("plan: warm-up to step 2000 (3456000 samples), cosine decay to step ")  # the schedule
    assert lines[2].startswith(memory)
    assert lines[2].endswith("; fits 79.6 GiB")


# Run Q (docs/172b-layout.md §9; raw: docs/perf-raw/run-q/summary-tp-memory.txt and slice-tp2-memory.log):
# `bash h200_tp.sh memory` (that run's script, retired) on two H200s, the llmjp3-172b preset with 3 layers and a
# 49,920-row vocabulary at TP2 x PP1 x DP1, selective recompute, micro batch 1, global batch 2,
# ds_configs/pipeline.json, BF16: torch.cuda.max_memory_allocated peaked at 59.147 GiB (steps 2-3). The CUDA
# context and NCCL are not in that figure; the estimate allows CONTEXT_GIB (1.5) for them.
RUN_Q_MAX_ALLOCATED_GIB = 59.147


def slice_estimate():
    shape = resolve_shape("llmjp3-172b", {"num_layers": 3, "vocab_size": 49920})
    (stage,) = layout_memory(shape, [3], 1, 1, 4096, 2, "selective", 2)
    return stage


def test_the_tp2_slice_estimate_against_run_q():
    """The estimate of the measured slice must cover the measured allocation and stay within 10 % above the
    measured allocation + the context allowance (8 B per parameter and an always-counted bucket gave 68.0 GiB:
    outside the band)."""
    stage = slice_estimate()
    assert stage.params == 3_268_890_624 and stage.in_flight == 1
    assert (round(stage.weights_grads_accum, 1), round(stage.optimizer, 1), round(stage.activations, 1),
            round(stage.logits, 1), round(stage.transient, 1), round(stage.total, 1)) == \
        (18.3, 36.5, 2.4, 1.1, 1.6, 60.0)
    assert RUN_Q_MAX_ALLOCATED_GIB <= stage.total <= 1.10 * (RUN_Q_MAX_ALLOCATED_GIB + CONTEXT_GIB)
    # the old model, for the record: 2 more bytes per (non-norm) parameter and the bucket at DP 1
    norms = 3 * 2 * H + H
    old = stage.total + (2 * (stage.params - norms) + ALLREDUCE_BUCKET_BYTES) / GIB
    assert round(old, 1) == 68.0 and old > 1.10 * (RUN_Q_MAX_ALLOCATED_GIB + CONTEXT_GIB)
    # DeepSpeed's report after building BF16_Optimizer: MA 30.48 (GiB) = 10 B per parameter, no bf16 gradients
    assert round(10 * stage.params / GIB, 1) == 30.4


def test_async_checkpoint_snapshots_per_rank_and_per_node():
    """The 172B preset (TP4 x PP16 x DP8, 8 ranks per node): a node holds one TP group of two data ranks of a
    stage; data rank 0's four TP ranks write the model states (bf16 weights, 2 bytes a parameter) and all eight
    write their ZeRO-1 shard (12 bytes over DP)."""
    from llmjp_ds.parallel.memory import node_snapshot_gib, snapshot_gib

    stage = busiest(layout(16, "selective", 4))
    writer = (2 * stage.params + 12 * stage.params / 8) / GIB
    other = 12 * stage.params / 8 / GIB
    assert snapshot_gib(stage, 8, 2) == pytest.approx(writer)
    assert snapshot_gib(stage, 8, 2, writes_model_states=False) == pytest.approx(other)
    assert node_snapshot_gib(stage, 8, 2, 8) == pytest.approx(4 * writer + 4 * other)
    assert round(snapshot_gib(stage, 8, 2), 1) == 9.7 and round(node_snapshot_gib(stage, 8, 2, 8), 1) == 55.2
    # one process (the 1.8B on one GPU, fp32 run alike): the whole checkpoint, weights and optimizer
    (one,) = layout_memory(resolve_shape("llmjp3-1.8b", {}), [24], 1, 2, 4096, 8, "none", 1)
    assert node_snapshot_gib(one, 1, 2, 1) == pytest.approx(14 * one.params / GIB)


def test_preflight_interval_line_from_a_disk_speed():
    """``preflight --disk-gbps``: the write time of the node's snapshot, and with ``--step-seconds`` the trainer's
    own advice when ``checkpoint.interval`` is shorter than the write (the H200's 1.8B: 24.4 GiB at 1 GB/s)."""
    from llmjp_ds.preflight import interval_line

    assert interval_line(6, 24.4, 1.0, None).startswith("a save writes ~26 s at 1 GB/s: keep checkpoint.interval "
                                                       "above 26 s")
    assert interval_line(6, 24.4, 1.0, 1.4).startswith("warning: a background save writes 24.40 GiB at 1.00 GB/s")
    assert interval_line(6, 24.4, 1.0, 1.4).endswith("set checkpoint.interval to at least 19, or write the run "
                                                     "directory to a faster disk")
    assert interval_line(20, 24.4, 1.0, 1.4) == ("a save writes ~26 s at 1 GB/s; checkpoint.interval=20 leaves it "
                                                 "28 s (it needs at least 19 steps)")


# run AI (docs/performance.md): llmjp4-moe-slice, micro-batch 1 of 4096, GAS 8, ZeRO-1, bf16, one H200, no
# recompute: torch.cuda.max_memory_allocated of ours-bf16 (docs/perf-raw/run-ai/)
RUN_AI_MOE_SLICE_GIB = 87.6


@pytest.mark.parametrize("shape_name, dense_layers", [("tiny-moe", ()), ("tiny-moe", (0, 2))])
def test_an_moe_models_parameters_are_the_built_models(shape_name, dense_layers):
    """Every parameter of the model as built (the torch twin, TE's names and layout): a dense layer's MLP, an MoE
    layer's router and experts, qk-norm's weights; and llm-jp-4-32b-a3b's model-card total, exactly."""
    from llmjp_ds.model import LlamaForCausalLM, model_config

    shape = resolve_shape(shape_name, {"dense_layers": dense_layers})
    config = model_config(shape)
    built = sum(p.numel() for p in LlamaForCausalLM(config, backend="torch").parameters())
    (one,) = layout_memory(shape, [shape.num_layers], 1, 1, 256, 1)
    assert one.params == built
    (whole,) = layout_memory(get_shape("llmjp4-32b-a3b"), [32], 1, 1, 4096, 1)
    assert whole.params == 32_139_028_992


def test_expert_parallelism_splits_the_experts_and_shards_their_optimizer_over_the_expert_data_group():
    """EP 4 over DP 8: a GPU holds a quarter of each MoE layer's experts, and their master weights and moments are
    sharded over the 2 ranks holding the same experts, the rest over all 8; a dense layer (layer 0 here) is
    replicated; a pipeline's stages count their own layers' experts."""
    shape = resolve_shape("tiny-moe", {"dense_layers": (0,)})
    (ep1,), (ep4,) = (layout_memory(shape, [4], 8, 1, 256, 1, expert=e) for e in (1, 4))
    experts = 3 * layer_expert_params(shape)  # three MoE layers
    assert ep1.params - ep4.params == experts * 3 // 4
    dense = ep4.params - experts // 4
    assert ep4.optimizer == pytest.approx(12 * (dense / 8 + experts / 4 / 2) / GIB)
    first, second = layout_memory(shape, [1, 3], 2, 1, 256, 1, expert=2)
    assert (first.params, second.params) == (
        layer_params(shape, index=0) + shape.vocab_size * shape.hidden_size,
        sum(layer_params(shape, index=i, expert=2) for i in (1, 2, 3)) + shape.vocab_size * shape.hidden_size
        + shape.hidden_size)
    # each MoE layer's activations: a dense layer's less its MLP's 9.5 [s, b, h] tensors, plus 2 k rows, fc1's and
    # SwiGLU's 3 k f / h and the router's fp32 logits and probabilities 4 E / h (h 128, k 2, f 64, E 8: -2.25)
    (dense,) = layout_memory(dataclasses.replace(shape, num_experts=0), [4], 8, 1, 256, 1)
    sbh = 256 * 128 * 2
    assert (ep4.activations - dense.activations) * GIB == pytest.approx(3 * (4 + 3 + 0.25 - 9.5) * sbh)


def layer_expert_params(shape) -> int:
    return shape.num_experts * 3 * shape.hidden_size * shape.moe_ffn_hidden_size


def test_the_moe_estimate_covers_run_ais_measured_slice():
    """As run Q's slice for a dense stage: the estimate of what one H200 held for llmjp4-moe-slice must cover the
    measured allocation and stay within 10 % above it plus the context allowance. The dense formula (the experts
    counted as one MLP of the config's 7,680) said 34.6 GiB."""
    (stage,) = layout_memory(get_shape("llmjp4-moe-slice"), [4], 1, 1, 4096, 8, "none")
    assert RUN_AI_MOE_SLICE_GIB <= stage.total <= 1.10 * (RUN_AI_MOE_SLICE_GIB + CONTEXT_GIB)
