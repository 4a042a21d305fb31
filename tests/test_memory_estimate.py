"""``parallel.memory``: the per-stage memory of a layout, pinned to the tables of docs/172b-layout.md (llmjp3-172b,
micro batch 1, seq 4096, global batch 1728 on 512 GPUs, bf16 + ZeRO-1; TP with sequence parallelism)."""

from __future__ import annotations

import pytest

from llmjp_ds.model.shapes import get_shape
from llmjp_ds.parallel.memory import GIB, layer_params, layout_memory, stage_layers

SHAPE = get_shape("llmjp3-172b")
H = 12288


def layers_of(pp: int) -> list[int]:
    from llmjp_ds.model import model_config
    from llmjp_ds.model.pipeline import flops_weights, stage_bounds

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
@pytest.mark.parametrize("pp,unsharded,sharded,total", [(8, 167.4, 3.9, 186.0), (16, 88.3, 4.1, 107.9),
                                                        (32, 48.7, 4.6, 70.2), (64, 35.5, 6.7, 65.1)])
def test_busiest_gpu_of_each_candidate(pp, unsharded, sharded, total):
    stage = busiest(layout(pp))
    assert stage.stage == 0
    assert (round(stage.weights_grads_accum, 1), round(stage.optimizer, 1), round(stage.total, 1)) == \
        (unsharded, sharded, total)


# §4: TP x PP on 512 GPUs: the busiest GPU with selective and with full recompute, and the
# projected seconds per step of the fastest recompute mode that fits 79.6 GiB (None: neither fits)
@pytest.mark.parametrize("tp,pp,selective,full,seconds", [
    (1, 8, 328.5, 186.0, None), (1, 16, 250.4, 107.9, None), (1, 32, 212.7, 70.2, 61.3),
    (2, 8, 168.0, 96.8, None), (2, 16, 129.0, 57.8, 56.0), (2, 32, 110.4, 39.2, 56.2),
    (4, 8, 87.7, 52.1, 55.6), (4, 16, 68.3, 32.7, 42.5), (4, 32, 59.2, 23.6, 42.6),
    (8, 8, 47.5, 29.7, 45.5), (8, 16, 38.0, 20.1, 45.6), (8, 32, 33.6, 15.8, 45.7),
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
    """§5: PP 32 x DP 16: stage 0 70.2 GiB, stage 1 59.9 GiB, the last stage (with the logits) 63.2 GiB."""
    stages = layout(32)
    assert [round(stages[i].total, 1) for i in (0, 1, 31)] == [70.2, 59.9, 63.2]
    assert round(stages[31].logits, 1) == 4.6 and stages[31].in_flight == 1 and stages[0].in_flight == 32


def test_the_recommended_layout_stage_by_stage():
    """§5: TP4 x PP16 x DP8, selective: stage 0 68.3 GiB, stage 1 63.2 GiB, the last stage 33.2 GiB."""
    stages = layout(16, "selective", 4)
    first = stages[0]
    assert (round(first.weights_grads_accum, 1), round(first.optimizer, 1), round(first.activations, 1),
            round(first.transient, 1), round(first.total, 1)) == (22.1, 4.1, 38.6, 3.5, 68.3)
    assert [round(stages[i].total, 1) for i in (0, 1, 15)] == [68.3, 63.2, 33.2]
    assert stages[0].in_flight == 16 and stages[15].in_flight == 1
    # LLM-jp's Megatron layout, the same split: 2 + 4 + 12 / 8 bytes per parameter (distributed optimizer)
    assert round(first.params * (2 + 4 + 12 / 8) / GIB, 1) == 20.7


def test_recompute_modes_are_checked():
    with pytest.raises(ValueError, match="recompute"):
        layout(32, "partial")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sets,config,memory", [
    ([], "gradient accumulation", "busiest GPU: stage "),
    (["parallel.tensor_parallel=1", "parallel.pipeline_stages=32", "model.recompute=full"],
     "PP32 x DP16, ZeRO-1, gradient accumulation 108",
     "busiest GPU: stage 0 (3 layers), ~70.2 GiB = weights+grads+fp32 accum 48.7 + "),
    (["parallel.tensor_parallel=4", "parallel.pipeline_stages=16", "model.recompute=selective"],
     "DP8, ZeRO-1, gradient accumulation 216",
     ("busiest GPU: stage 0 (6 layers, TP4 shard), ~68.3 GiB = weights+grads+fp32 accum 22.1 + master+Adam 4.1 + "
      "activations 38.6 (16 micro-batches in flight, recompute selective) + transient 3.5")),
])
def test_preflight_prints_the_busiest_gpu_of_the_configured_layout(sets, config, memory):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "llmjp_ds.cli", "preflight", "--hostfile", "hostfiles/h100",
                          "--preset", "llmjp3-172b", *[a for s in sets for a in ("--set", s)]],
                         cwd=repo, capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if not line.startswith("[")]  # DeepSpeed's own log lines
    assert config in lines[0]
    assert lines[1].startswith(memory)
    assert lines[1].endswith("; fits 79.6 GiB")
