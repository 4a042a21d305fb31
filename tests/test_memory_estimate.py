"""``parallel.memory``: the per-stage memory of a layout, pinned to the tables of docs/172b-layout.md (llmjp3-172b,
micro batch 1, seq 4096, global batch 1728 on 512 GPUs, full recompute, bf16 + ZeRO-1)."""

from __future__ import annotations

import pytest

from llmjp_ds.model.shapes import get_shape
from llmjp_ds.parallel.memory import layer_params, layout_memory, stage_layers

SHAPE = get_shape("llmjp3-172b")


def layers_of(pp: int) -> list[int]:
    from llmjp_ds.model import model_config
    from llmjp_ds.model.pipeline import flops_weights, stage_bounds

    return stage_layers(stage_bounds(flops_weights(model_config("llmjp3-172b"), 4096), pp), 96)


def layout(pp: int, full_recompute: bool = True):
    dp = 512 // pp
    return layout_memory(SHAPE, layers_of(pp), dp, 1, 4096, 1728 // dp, full_recompute)


def test_one_decoder_layer_has_the_documented_parameters():
    assert layer_params(SHAPE) == 1_770_283_008


# docs/172b-layout.md §1: parameters of stage 0, a middle stage and the last stage
@pytest.mark.parametrize("pp,first,middle,last", [
    (8, 22_470_230_016, 21_243_396_096, 22_470_242_304),
    (16, 11_848_531_968, 10_621_698_048, 11_848_544_256),
    (32, 6_537_682_944, 5_310_849_024, 6_537_695_232),
    (64, 4_767_399_936, 3_540_566_016, 2_997_129_216),
])
def test_parameters_per_stage(pp, first, middle, last):
    stages = layout(pp)
    assert (stages[0].params, stages[1].params, stages[-1].params) == (first, middle, last)


# §3: stage 0's activations in flight, full and selective (no full) recompute, GiB
@pytest.mark.parametrize("pp,full,selective", [(8, 9.8, 153.8), (16, 10.5, 154.5), (32, 12.0, 156.0),
                                                (64, 18.0, 210.0)])
def test_stage_zero_activations(pp, full, selective):
    assert round(layout(pp)[0].activations, 1) == full
    assert round(layout(pp, full_recompute=False)[0].activations, 1) == selective


# §4: the candidate layouts' busiest GPU (stage 0) and its parts, GiB
@pytest.mark.parametrize("pp,unsharded,sharded,total", [(8, 167.4, 3.9, 186.0), (16, 88.3, 4.1, 107.9),
                                                        (32, 48.7, 4.6, 70.2), (64, 35.5, 6.7, 65.1)])
def test_busiest_gpu_of_each_candidate(pp, unsharded, sharded, total):
    stages = layout(pp)
    busiest = max(stages, key=lambda s: s.total)
    assert busiest.stage == 0
    assert (round(busiest.weights_grads_accum, 1), round(busiest.optimizer, 1), round(busiest.total, 1)) == \
        (unsharded, sharded, total)


def test_the_recommended_layout_stage_by_stage():
    """§5: PP 32 x DP 16: stage 0 70.2 GiB, stage 1 59.9 GiB, the last stage (with the logits) 63.2 GiB."""
    stages = layout(32)
    assert [round(stages[i].total, 1) for i in (0, 1, 31)] == [70.2, 59.9, 63.2]
    assert round(stages[31].logits, 1) == 4.6 and stages[31].in_flight == 1 and stages[0].in_flight == 32


@pytest.mark.timeout(120)
def test_preflight_prints_the_busiest_gpu_of_the_configured_layout():
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "llmjp_ds.cli", "preflight", "--hostfile", "hostfiles/h100",
                          "--preset", "llmjp3-172b"], cwd=repo, capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if not line.startswith("[")]  # DeepSpeed's own log lines
    assert lines[0].endswith("config OK: PP32 x DP16, ZeRO-1, gradient accumulation 108")
    assert lines[1].startswith("busiest GPU: stage 0 (3 layers), ~70.2 GiB = weights+grads+fp32 accum 48.7 + ")
    assert lines[1].endswith("; fits 79.6 GiB")
