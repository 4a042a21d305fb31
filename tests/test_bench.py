"""``llmjp-ds bench`` on CPU: kernel categories, the profile summary's arithmetic, the per-variant run config,
the CLI's error path, and the harness itself on the tiny shape (real DeepSpeed steps, one process each)."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from llmjp_ds.bench import profile as bench_profile
from llmjp_ds.bench import run as bench

REPO = Path(__file__).resolve().parents[1]

# --- kernel categories ---------------------------------------------------------------------------------------

# names as torch.profiler reports them on an H200 (most from docs/perf-raw), and an unknown one
KERNELS = {
    "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "gemm",
    "nvjet_sm90_qqtst_320x128_128x3_1x2_h_bz_coopB_TNT": "gemm",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel":
        "gemm",
    "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_1x4x1_cga1x1x1_kernel0_0":
        "attention",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1x1_kernel0_0":
        "attention",
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL": "communication",
    "ncclDevKernel_AllGather_RING_LL": "communication",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    "FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
    "(at::native::_fused_mode)1, false>, bool, float, float, float, float, float, double*, bool, float*, float*>"
    "(T1, T2, T3...)": "optimizer",
    "Memcpy DtoD (Device -> Device)": "memcpy/memset",
    "Memcpy HtoD (Pageable -> Device)": "memcpy/memset",
    "Memset (Device)": "memcpy/memset",
    "void transformer_engine::detail::cast_transpose_kernel<true, 8, float>": "fp8 cast/transpose",
    "void rmsnorm_fwd_tuned_kernel<bf16>": "norm",
    "void transformer_engine::fused_rope_forward_kernel<__nv_bfloat16, float>": "rope",
    "triton_red_fused__log_softmax__to_copy_mul_pow_sum_0": "compiled (loss)",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >"
    "(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)": "elementwise/reduce",
    # torch's dtype-converting elementwise kernels (the fp32 gradient add of a bf16 run): not FP8 casts
    "void at::native::unrolled_elementwise_kernel<at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>, 4, "
    "TrivialOffsetCalculator<2, unsigned int>, TrivialOffsetCalculator<1, unsigned int>, "
    "at::native::memory::LoadWithCast<2>, at::native::memory::StoreWithCast<1> >(int, "
    "at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>, TrivialOffsetCalculator<2, unsigned int>, "
    "TrivialOffsetCalculator<1, unsigned int>, at::native::memory::LoadWithCast<2>, "
    "at::native::memory::StoreWithCast<1>)": "elementwise/reduce",
    "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<"
    "c10::BFloat16, c10::BFloat16, c10::BFloat16, at::native::binary_internal::MulFunctor<float> > >"
    "(at::TensorIteratorBase&, at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, c10::BFloat16, "
    "at::native::binary_internal::MulFunctor<float> > const&)::{lambda(int)#1}>(int, "
    "at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, c10::BFloat16, "
    "at::native::binary_internal::MulFunctor<float> > >(at::TensorIteratorBase&, at::native::BinaryFunctor<"
    "c10::BFloat16, c10::BFloat16, c10::BFloat16, at::native::binary_internal::MulFunctor<float> > const&)::"
    "{lambda(int)#1})": "elementwise/reduce",
    "void transformer_engine::gated_act_kernel<__nv_bfloat16, float, &transformer_engine::silu>": "activation",
    "my_unheard_of_kernel_v2": "other",
}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_category(name):
    assert bench_profile.kernel_category(name) == KERNELS[name]


def test_every_category_is_reachable_and_other_is_the_fallback():
    categories = {c for c, _ in bench_profile.KERNEL_CATEGORIES}
    assert set(KERNELS.values()) == categories | {"other"}
    assert bench_profile.kernel_category("") == "other"


# --- profile summary -----------------------------------------------------------------------------------------

GEMM_A, GEMM_B = "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT"
FLASH = "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7"
NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL"
COPY = "Memcpy DtoD (Device -> Device)"
ODD = "my_unheard_of_kernel_v2"
# (name, microseconds) of one step: gemm 300+150+200 = 650, attention 180, communication 70, other 60, memcpy 4x10;
# the most frequent kernel (COPY) is the lightest
SYNTHETIC = [(GEMM_A, 300.0), (COPY, 10.0), (FLASH, 120.0), (GEMM_B, 150.0), (COPY, 10.0), (NCCL, 70.0),
             (GEMM_A, 200.0), (FLASH, 60.0), (COPY, 10.0), (ODD, 60.0), (COPY, 10.0)]
BUSY_US = 1000.0


def test_profile_summary_categories_and_shares():
    s = bench_profile.profile_summary(SYNTHETIC, wall_s=0.004)
    assert s["wall_ms"] == pytest.approx(4.0)
    assert s["gpu_busy_ms"] == pytest.approx(BUSY_US / 1e3)
    assert s["idle_share"] == pytest.approx(1 - BUSY_US / 4000.0)  # 0.75
    cats = [(c["category"], c["ms"], c["share"]) for c in s["categories"]]
    expected = [("gemm", 0.65), ("attention", 0.18), ("communication", 0.07), ("other", 0.06),
                ("memcpy/memset", 0.04)]
    assert [c for c, _, _ in cats] == [c for c, _ in expected]  # heaviest first
    for (_, ms, share), (_, want_ms) in zip(cats, expected):
        assert ms == pytest.approx(want_ms)
        assert share == pytest.approx(want_ms * 1e3 / BUSY_US)
    assert sum(share for _, _, share in cats) == pytest.approx(1.0)
    assert sum(ms for _, ms, _ in cats) == pytest.approx(s["gpu_busy_ms"])


def test_profile_summary_top_kernels_sorted_with_call_counts():
    s = bench_profile.profile_summary(SYNTHETIC, wall_s=0.004)
    top = [(k["kernel"], k["ms"], k["calls"], k["category"]) for k in s["top_kernels"]]
    assert [t[0] for t in top] == [GEMM_A, FLASH, GEMM_B, NCCL, ODD, COPY]
    assert top[0][1:] == (pytest.approx(0.5), 2, "gemm")
    assert top[1][1:] == (pytest.approx(0.18), 2, "attention")
    assert top[2][1:] == (pytest.approx(0.15), 1, "gemm")
    assert top[-1][1:] == (pytest.approx(0.04), 4, "memcpy/memset")
    assert [k["ms"] for k in s["top_kernels"]] == sorted((k["ms"] for k in s["top_kernels"]), reverse=True)
    assert sum(k["calls"] for k in s["top_kernels"]) == len(SYNTHETIC) == s["kernels"]
    assert [k["kernel"] for k in bench_profile.profile_summary(SYNTHETIC, 0.004, top=2)["top_kernels"]] == [GEMM_A, FLASH]
    long = "nvjet_" + "x" * 300
    assert bench_profile.profile_summary([(long, 1.0)], 1.0)["top_kernels"][0]["kernel"] == long[:110]


def test_profile_summary_edges():
    # kernels longer than the wall time (clock skew): no negative idle; no kernels: all idle, no categories
    assert bench_profile.profile_summary(SYNTHETIC, wall_s=0.0005)["idle_share"] == 0.0
    assert bench_profile.profile_summary(SYNTHETIC, wall_s=0.0)["idle_share"] == 0.0  # no wall time measured
    empty = bench_profile.profile_summary([], wall_s=0.01)
    assert empty["idle_share"] == pytest.approx(1.0)
    assert empty["categories"] == [] and empty["top_kernels"] == [] and empty["gpu_busy_ms"] == 0.0


def test_host_summary_orders_by_self_and_cumulative_time_and_shortens_paths():
    rows = [("/x/site-packages/transformer_engine/pytorch/module/linear.py", 10, "forward", 72, 0.010, 0.050),
            ("/repo/llmjp_ds/train.py", 5, "forward_backward", 1, 0.001, 0.900),
            ("~", 0, "<method 'item' of 'torch._C.TensorBase' objects>", 8, 0.300, 0.300)]
    h = bench_profile.host_summary(rows, wall_s=1.2, top=2)
    assert h["wall_ms"] == pytest.approx(1200.0)
    assert [f["function"] for f in h["by_self"]] == ["~:0(<method 'item' of 'torch._C.TensorBase' objects>)",
                                                     "transformer_engine/pytorch/module/linear.py:10(forward)"]
    assert [f["function"] for f in h["by_cumulative"]] == ["train.py:5(forward_backward)",
                                                           "~:0(<method 'item' of 'torch._C.TensorBase' objects>)"]
    assert h["by_self"][1]["calls"] == 72 and h["by_self"][1]["self_ms"] == pytest.approx(10.0)
    assert h["by_cumulative"][0]["cum_ms"] == pytest.approx(900.0)


def test_sync_summary_counts_by_site_and_renders_under_the_profile():
    sites = [("/x/site-packages/deepspeed/runtime/bf16_optimizer.py", 402)] + [("/repo/llmjp_ds/train.py", 90)] * 8
    s = bench_profile.sync_summary(sites, top=1)
    assert s == {"count": 9, "sites": [{"where": "train.py:90", "calls": 8}]}
    result = {"shape": "tiny", "variant": "ours-bf16", "gas": 8, "syncs": s,
              "profile": bench_profile.profile_summary([("gemm", 10.0)], 1e-3)}
    text = bench_profile.profile_table(result)
    assert "host synchronisations in one step of 8 micro-batches: 9" in text and "| `train.py:90` | 8 |" in text


def _x(cat, name, ts, dur, tid=1, corr=None):
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


# a forward on thread 1 (an autograd function's GEMM, launched late), a backward on thread 2, and kernels that
# queue back to back; times in microseconds
BACKWARD = "autograd::engine::evaluate_function: _LayerNormLinearBackward"
TRACE = [
    _x("cpu_op", "_LayerNormLinear", 0, 100), _x("cpu_op", "aten::mm", 10, 80),
    _x("cuda_runtime", "cudaLaunchKernel", 20, 5, corr=1), _x("cuda_runtime", "cudaLaunchKernel", 85, 5, corr=2),
    _x("kernel", "gemm_a", 30, 10, tid=7, corr=1),
    _x("kernel", "gemm_b", 95, 10, tid=7, corr=2),  # 55 us after gemm_a: the host was inside aten::mm
    _x("kernel", "gemm_c", 107, 10, tid=7, corr=3),  # 2 us: queued
    _x("cuda_runtime", "cudaLaunchKernel", 100, 2, corr=3),
    _x("cpu_op", BACKWARD, 150, 300, tid=2),
    _x("cpu_op", "aten::add", 400, 20, tid=2), _x("cuda_driver", "cuLaunchKernel", 410, 3, tid=2, corr=4),
    _x("kernel", "triton_add", 420, 5, tid=7, corr=4),  # 303 us after gemm_c, launched in the backward
    _x("gpu_memset", "Memset", 426, 1, tid=7, corr=5),  # its launch was not traced
    _x("user_annotation", "step", 0, 500),
]


MOE_TRACE = [
    _x("cpu_op", "fused_topk_with_score_function", 0, 50), _x("cuda_runtime", "cudaLaunchKernel", 10, 2, corr=1),
    _x("cpu_op", "moe_permute_with_probs", 60, 40), _x("cuda_runtime", "cudaLaunchKernel", 70, 2, corr=2),
    _x("cpu_op", "_GroupedLinear", 110, 100), _x("cpu_op", "aten::mm", 120, 50),
    _x("cuda_runtime", "cudaLaunchKernel", 130, 2, corr=3),
    _x("cpu_op", "aten::add", 300, 10), _x("cuda_runtime", "cudaLaunchKernel", 302, 2, corr=4),
    _x("cpu_op", "autograd::engine::evaluate_function: _GroupedLinearBackward", 400, 100, tid=2),
    _x("cuda_runtime", "cudaLaunchKernel", 410, 2, tid=2, corr=5),
    _x("kernel", "topk_kernel", 20, 4, tid=7, corr=1), _x("kernel", "permute_kernel", 80, 6, tid=7, corr=2),
    _x("kernel", "nvjet_gemm", 140, 30, tid=7, corr=3), _x("kernel", "add_kernel", 310, 10, tid=7, corr=4),
    _x("kernel", "nvjet_gemm_dgrad", 420, 50, tid=7, corr=5),
]


def test_moe_shares_put_each_kernel_down_to_the_moe_part_whose_op_launched_it():
    """Forward and backward (the autograd function's name on the backward thread), grouped GEMM, permutation and
    routing apart; a kernel under none of them is other."""
    shares = bench_profile.moe_shares(MOE_TRACE)
    assert {k: v["ms"] for k, v in shares.items()} == {"grouped GEMM": pytest.approx(0.080),
                                                        "permutation": pytest.approx(0.006),
                                                        "routing": pytest.approx(0.004), "other": pytest.approx(0.010)}
    assert shares["grouped GEMM"]["share"] == pytest.approx(0.8)


def test_idle_gaps_puts_each_wait_on_the_op_that_launched_the_next_kernel():
    g = bench_profile.idle_gaps(TRACE, queued_us=5.0)
    assert g["short"] == 2 and g["short_ms"] == pytest.approx(0.003)  # 2 us and 1 us
    assert g["long"] == 2 and g["long_ms"] == pytest.approx(0.358)
    assert g["by_side"] == {"backward": pytest.approx(0.303), "forward/step": pytest.approx(0.055)}
    outer = {r["op"]: r["ms"] for r in g["by_outer"]}
    inner = {r["op"]: r["ms"] for r in g["by_inner"]}
    # thread 1's outermost op is the step's annotation; thread 2 has only the autograd function
    assert outer == {BACKWARD[:100]: pytest.approx(0.303), "step": pytest.approx(0.055)}
    assert inner == {"aten::add": pytest.approx(0.303), "aten::mm": pytest.approx(0.055)}
    assert bench_profile.idle_gaps(TRACE, queued_us=500.0)["long"] == 0


def test_idle_gaps_renders_under_the_profile_and_survives_an_unlaunched_kernel():
    trace = [_x("kernel", "a", 0, 10, corr=1), _x("kernel", "b", 50, 10, corr=99)]
    g = bench_profile.idle_gaps(trace)
    assert g["by_inner"] == [{"op": "(unknown)", "ms": pytest.approx(0.04), "gaps": 1}]
    assert bench_profile.idle_gaps([])["long"] == 0
    profile = {**bench_profile.profile_summary([("gemm", 10.0)], 1e-3), "idle_gaps": bench_profile.idle_gaps(TRACE)}
    text = bench_profile.profile_table({"shape": "tiny", "variant": "ours-bf16", "gas": 8, "profile": profile})
    assert "GPU waiting for the host: 0.4 ms in 2 gaps of 5 us or more (backward 0.3 ms, forward/step 0.1 ms)" in text
    assert "| `aten::add` | 0.3 | 1 |" in text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_synced_step_finds_each_synchronising_call_and_its_line():
    x = torch.ones(4, device="cuda")

    def step():
        y = x * 2  # queued: no wait
        first = y.sum().item()  # waits
        return first + float(y.max())  # waits

    line = step.__code__.co_firstlineno
    s = bench_profile.synced_step(step, torch.cuda.synchronize)
    assert s["count"] == 2
    assert sorted(x["where"] for x in s["sites"]) == sorted(
        f"{bench_profile._short_path(__file__)}:{line + n}" for n in (2, 3))


# --- the run config of a variant -----------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", ["delayed", "current", "block"])
def test_fp8_variant_is_one_fp8_phase_from_step_0(recipe):
    cfg = bench.bench_config("172b-slice", f"ours-fp8-{recipe}", 8)
    phases = cfg.precision.phases
    assert len(phases) == 1
    ph = phases[0]
    assert (ph.precision, ph.start_step, ph.start_tokens, ph.recipe, ph.fp8_format) == ("fp8", 1, None, recipe,
                                                                                       "hybrid")
    assert cfg.precision.dtype == "bf16"


@pytest.mark.parametrize("variant", ["ours-bf16", "peer-bf16"])
def test_bf16_variants_have_one_bf16_phase(variant):
    cfg = bench.bench_config("172b-slice", variant, 8)
    assert [(p.precision, p.start_step) for p in cfg.precision.phases] == [("bf16", 1)]
    assert cfg.precision.dtype == "bf16"


@pytest.mark.parametrize("shape,gas", [("172b-slice", 8), ("llmjp3-1.8b", 4), ("llmjp3-3.7b", 3), ("tiny", 2),
                                       ("llmjp4-8b-slice", 8)])
def test_one_device_layout_and_batch(shape, gas):
    from llmjp_ds.config import preset_dict
    from llmjp_ds.model.shapes import overrides_dict
    from llmjp_ds.validate import validate_run

    preset, overrides, micro = {**bench.SHAPES, **bench.TEST_SHAPES}[shape]
    cfg = bench.bench_config(shape, "ours-bf16", gas)
    assert cfg.model.shape == preset_dict(preset)["model"]["shape"]
    assert cfg.train.micro_batch_size == micro
    assert cfg.train.global_batch_size == micro * gas
    layout = validate_run(cfg, 1)  # a valid single-device run (run_one validates the same way)
    assert layout.gradient_accumulation_steps(cfg.train.global_batch_size, cfg.train.micro_batch_size) == gas
    assert cfg.parallel.pipeline_stages == 1  # the 172B preset itself has 32 stages
    assert cfg.parallel.zero_stage == 1
    assert cfg.model.recompute == "none"  # the 172B preset itself recomputes
    assert overrides_dict(cfg.model.overrides) == overrides
    assert cfg.logging.wandb == "disabled"


def test_set_applies_to_ours_variants_only():
    from llmjp_ds.model.shapes import overrides_dict

    sets = ["model.fused_loss=false", "parallel.fused_grad_accumulation=false", "precision.fp8_weight_cache=false"]
    for variant in ("ours-bf16", "ours-fp8-current"):
        cfg = bench.bench_config("172b-slice", variant, 8, sets)
        assert cfg.model.fused_loss is False
        assert cfg.parallel.fused_grad_accumulation is False
        assert cfg.precision.fp8_weight_cache is False
    peer = bench.bench_config("172b-slice", "peer-bf16", 8, sets)
    assert peer.model.fused_loss is True and peer.parallel.fused_grad_accumulation is True
    assert peer.precision.fp8_weight_cache is True
    # a set that changes the shape's own override is merged into it, not replacing it
    cfg = bench.bench_config("172b-slice", "ours-bf16", 8, ["model.overrides.hidden_size=256"])
    assert overrides_dict(cfg.model.overrides) == {"num_layers": 2, "hidden_size": 256}


def _cli_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "LLMJP_DS_DEBUG"):
        env.pop(key, None)  # a lone process picks a free port (parallel.context.init_distributed)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "llmjp-ds" / "torch_extensions"))
    return env


@pytest.mark.timeout(120)
def test_cli_bad_set_key_is_a_one_line_error():
    proc = subprocess.run([sys.executable, "-m", "llmjp_ds.bench.run", "--shapes", "172b-slice", "--set", "model.nope=1"],
                          cwd=REPO, env=_cli_env(), capture_output=True, text=True, timeout=100)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and "model.nope" in lines[0]
    assert "Traceback" not in proc.stderr and "RESULT" not in proc.stdout


# --- the harness on CPU: real DeepSpeed steps on the tiny shape ------------------------------------------------

GAS, STEPS, WARMUP = 2, 2, 1
RUNS = {  # key: (shape, variant, --set, other arguments)
    "ours": ("tiny", "ours-bf16", [], []),
    "ours-unfused": ("tiny", "ours-bf16", ["parallel.fused_grad_accumulation=false"], []),
    "peer": ("tiny", "peer-bf16", [], []),
    "stage": ("tiny-stage", "ours-bf16", [], []),
    "profiled": ("tiny", "ours-bf16", [], ["--profile"]),
}


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """The three ``--one tiny`` runs, started together (one thread each) and parsed once for the module."""
    procs = {}
    for key, (shape, variant, sets, extra) in RUNS.items():
        cmd = [sys.executable, "-m", "llmjp_ds.bench.run", "--one", shape, variant, "--steps", str(STEPS),
               "--warmup", str(WARMUP), "--gas", str(GAS)] + [a for s in sets for a in ("--set", s)] + extra
        procs[key] = subprocess.Popen(cmd, cwd=REPO, env=_cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True)
    results = {}
    try:
        for key, proc in procs.items():
            out, err = proc.communicate(timeout=240)
            lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
            results[key] = (proc.returncode, lines, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def result_of(harness, key) -> dict:
    rc, lines, err = harness[key]
    assert rc == 0 and len(lines) == 1, f"exit {rc}\n{err[-3000:]}"
    return json.loads(lines[0][len("RESULT "):])


def tiny_vocab() -> int:
    from llmjp_ds.model.shapes import model_config

    return model_config("tiny").vocab_size


@pytest.mark.timeout(300)
@pytest.mark.parametrize("key", ["ours", "peer"])
def test_harness_first_loss_is_that_of_a_uniform_guess(harness, key):
    r = result_of(harness, key)
    assert r["variant"] == RUNS[key][1] and r["shape"] == "tiny" and r["device"] == "cpu"
    assert len(r["losses"]) == WARMUP + STEPS
    assert all(math.isfinite(x) for x in r["losses"])
    assert abs(r["losses"][0] - math.log(tiny_vocab())) < 0.5


@pytest.mark.timeout(300)
def test_harness_throughput_arithmetic(harness):
    from llmjp_ds.model.flops import flops_per_token_for
    from llmjp_ds.model.shapes import model_config

    r = result_of(harness, "ours")
    micro = bench.TEST_SHAPES["tiny"][2]
    assert (r["micro_batch"], r["gas"], r["steps"]) == (micro, GAS, STEPS)
    seq = bench.bench_config("tiny", "ours-bf16", GAS).data.seq_len
    assert r["seq_len"] == seq
    assert r["step_s"] > 0
    tokens_per_s = GAS * micro * seq / r["step_s"]
    assert r["tokens_per_s"] == pytest.approx(tokens_per_s, rel=1e-6)
    flops = flops_per_token_for(model_config("tiny"), seq)
    assert r["tflops_per_gpu"] == pytest.approx(flops * tokens_per_s / 1e12, rel=1e-6)
    assert "mfu" not in r  # no peak is known for a CPU
    assert r["sets"] == [] and r["peak_mem_gib"] == 0.0


@pytest.mark.timeout(300)
def test_harness_fused_accumulation_trains_like_deepspeeds(harness):
    """The same start; then the embedding and head gradients summed in fp32 instead of rounded to bf16 per
    micro-batch (tests/parallel/test_fused_grad_accumulation.py checks them exactly): the same losses within bf16."""
    fused, unfused = result_of(harness, "ours"), result_of(harness, "ours-unfused")
    assert unfused["sets"] == ["parallel.fused_grad_accumulation=false"]
    assert fused["losses"][0] == unfused["losses"][0]
    assert fused["losses"][1:] == pytest.approx(unfused["losses"][1:], rel=2e-3)
    assert fused["losses"][1] != fused["losses"][0]  # the optimizer stepped: later losses depend on the gradients


@pytest.mark.timeout(300)
def test_harness_stage_shape_trains_our_decoder_layers_alone(harness):
    """``tiny-stage``: our decoder layers without embedding and head, through the trainer's engine. Its first
    loss is that of the same layers built in-process (same seed, bf16 as the engine holds them), its FLOPs are
    the decoder layers' only, and the optimizer stepped."""
    from llmjp_ds.bench.peers import stage_model
    from llmjp_ds.model.flops import layer_and_logits_flops_for
    from llmjp_ds.model.shapes import model_config

    r = result_of(harness, "stage")
    cfg = bench.bench_config("tiny-stage", "ours-bf16", GAS)
    config = model_config("tiny", head_dim=16)
    seq, micro = cfg.data.seq_len, cfg.train.micro_batch_size
    torch.manual_seed(cfg.train.seed)
    with torch.no_grad():
        model = stage_model(config, "torch", micro, seq, "cpu").bfloat16()
        assert model.freqs.dtype == torch.float32  # RoPE angles stay fp32, as the whole model computes them
        ref = model(None, None).loss.item()
    assert r["losses"][0] == pytest.approx(ref, rel=1e-3)
    assert r["losses"][1] != r["losses"][0]
    flops = layer_and_logits_flops_for(config, seq)[0] * config.num_hidden_layers
    assert r["tflops_per_gpu"] == pytest.approx(flops * r["tokens_per_s"] / 1e12, rel=1e-6)


# --- the table and the variants of a shape ----------------------------------------------------------------------

def _row(shape, variant, tflops):
    return {"shape": shape, "variant": variant, "tflops_per_gpu": tflops, "tokens_per_s": 1.0, "peak_mem_gib": 1.0,
            "alloc_retries": 0, "sets": []}


def test_the_megatron_peer_logs_its_loss_as_computed_not_as_megatron_rescales_it():
    """Megatron-Core's schedule divides the loss its loss function returns by the micro-batch count in place; the
    logged value must stay the mean (runs T, V and X logged 11.92 / 8)."""
    from llmjp_ds.bench.peers import mcore_loss

    per_token = torch.tensor([[11.0, 12.0], [13.0, 12.0]], dtype=torch.bfloat16)
    loss, logged = mcore_loss(per_token)
    loss /= 8  # what megatron/core/pipeline_parallel/schedules.py (0.19.2) does with it
    assert logged["lm loss"].item() == 12.0 and loss.item() == 1.5


def test_vs_peer_names_the_fastest_peer_of_the_rows_precision():
    rows = [_row("s", "ours-bf16", 560), _row("s", "peer-mcore-bf16", 500), _row("s", "peer-bf16", 400),
            _row("s", "ours-fp8-delayed", 880), _row("s", "peer-mcore-fp8-delayed", 780),
            _row("s", "peer-mcore-fp8-param", 800), _row("s", "ours-fp8-current", 700)]
    cells = {r["variant"]: bench.vs_peer(r, rows) for r in rows}
    assert cells["ours-bf16"] == "1.12x peer-mcore-bf16"
    assert cells["ours-fp8-delayed"] == "1.10x peer-mcore-fp8-param"
    assert cells["ours-fp8-current"] == "" and cells["peer-mcore-bf16"] == ""  # no peer of that precision
    rows[0]["losses"], rows[1]["losses"] = [11.926437, 11.9], [11.916799, 11.8]
    text = bench.table(rows)
    # vs peer, vs transformers + DeepSpeed, vs ours-bf16, first-step loss
    assert "| 1.12x peer-mcore-bf16 | 1.40x |  | 11.9264 |" in text
    assert "| peer-mcore-bf16 | 1 | 500 | 0.0% | 1.0 | 0 |  |  |  | 11.9168 |" in text
    # the clock column is empty where nvidia-smi gave no samples
    assert text.splitlines()[2].endswith("| 11.9264 |  |") and text.splitlines()[4].endswith("|  |  |  |  |  |")
    stage = [_row("t", "ours-fp8-current", 870), _row("t", "ref-te-layer-fp8-current", 867)]
    assert bench.vs_peer(stage[0], stage) == "1.00x ref-te-layer-fp8-current"


# --- the GPU's clock while the timed steps run --------------------------------------------------------------------

SMI_LINES = ["1980, 250.31, 0x0000000000000000", "1605, 699.76, 0x0000000000000004",
             "1515, 700.12, 0x0000000000000004", "[N/A], [N/A], [N/A]", "garbage", ""]


def test_clock_summary_means_and_power_capped_share():
    c = bench_profile.clock_summary(SMI_LINES)
    assert c["samples"] == 3
    assert c["sm_mhz"] == pytest.approx((1980 + 1605 + 1515) / 3)
    assert c["power_w"] == pytest.approx((250.31 + 699.76 + 700.12) / 3)
    assert c["power_capped"] == pytest.approx(2 / 3)
    assert bench_profile.clock_summary(["[N/A], [N/A], [N/A]"]) == {}


def test_clock_log_samples_nvidia_smi_while_the_block_runs(tmp_path, monkeypatch):
    """A stand-in nvidia-smi on PATH that prints one sample per call of its loop, as the real one does with
    ``--loop-ms``: the block's summary is filled from what it printed, and its arguments name the GPU."""
    args = tmp_path / "args.txt"
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho \"$@\" > {args}\n"
                   "while true; do echo '1605, 699.5, 0x0000000000000004'; echo '1980, 300, 0x0'; sleep 0.05; done\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with bench_profile.clock_log("GPU-1234") as clocks:
        assert clocks == {}
        time.sleep(0.5)
    assert clocks["samples"] >= 2 and 0 < clocks["power_capped"] < 1
    assert 1605 <= clocks["sm_mhz"] <= 1980
    assert "--id=GPU-1234" in args.read_text() and "clocks_throttle_reasons.active" in args.read_text()
    with bench_profile.clock_log(None) as none:  # no GPU: nothing sampled
        pass
    assert none == {}
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with bench_profile.clock_log("GPU-1234") as missing:  # no nvidia-smi
        pass
    assert missing == {}


def test_table_shows_the_clock_of_each_row():
    rows = [_row("s", "ours-bf16", 560), _row("s", "peer-mcore-bf16", 500)]
    rows[0]["gpu_clocks"] = bench_profile.clock_summary(SMI_LINES)
    text = bench.table(rows).splitlines()
    assert "SM MHz (power-capped)" in text[0]
    assert text[2].endswith("| 1,700 (67%) |") and text[3].endswith("|  |")


def test_variants_of_a_shape_and_their_errors(capsys):
    from llmjp_ds.errors import UserError

    assert bench.variants_for("172b-slice", None) == list(bench.DEFAULT_VARIANTS)
    assert bench.variants_for("172b-tp4-stage", None) == list(bench.STAGE_VARIANTS)
    assert bench.variants_for("172b-tp4-stage", "ours-bf16,ref-te-layer-bf16") == ["ours-bf16", "ref-te-layer-bf16"]
    for shape, variant in (("172b-slice", "ref-te-layer-bf16"), ("172b-tp4-stage", "peer-mcore-bf16"),
                           ("172b-tp4-stage", "peer-bf16"), ("172b-slice", "ours-fp9")):
        with pytest.raises((UserError, SystemExit)):
            bench.variants_for(shape, variant)
    assert bench.precision_of("peer-mcore-fp8-param") == "fp8-delayed"


def test_llmjp4_slice_is_four_layers_of_the_8b_with_its_whole_head():
    """The LLM-jp-4 8B's layer shape, 4 layers, the 196,608-row embedding and head; ours and the peers get the
    same model config, and its FLOPs are the layers' and the head's by hand (the head 46 % of them)."""
    from llmjp_ds.config import model_config_of
    from llmjp_ds.model.shapes import model_config

    cfg = bench.bench_config("llmjp4-8b-slice", "ours-bf16", 8)
    assert (cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.precision.dtype) == (1, 8, "bf16")
    got = model_config_of(cfg)
    assert got.to_dict() == model_config("llmjp4-8b", num_layers=4).to_dict()
    assert (got.num_hidden_layers, got.vocab_size, got.num_key_value_heads, got.head_dim) == (4, 196608, 8, 128)
    for variant in ("peer-mcore-bf16", "peer-bf16"):
        assert model_config_of(bench.bench_config("llmjp4-8b-slice", variant, 8)).to_dict() == got.to_dict()
    layer, head = 3 * 469_762_048, 3 * 2 * 4096 * 196608  # tests/model/test_presets.py works the layer out
    flops = bench.flops_per_token("llmjp4-8b-slice", got, 4096)
    assert flops == 4 * layer + head == 10_468_982_784
    assert head / flops == pytest.approx(0.4615, abs=1e-4)


def test_the_megatron_peer_gets_the_llmjp4_shape():
    """GPTModel's arguments at llmjp4-8b-slice: 8 query groups, no qk-layernorm, RMSNorm eps 1e-6, RoPE base
    500000, the vocabulary unpadded (196,608 is a multiple of 128 x TP already), the head untied."""
    from llmjp_ds.bench.peers import mcore_layer_shape, mcore_model_args
    from llmjp_ds.config import model_config_of

    config = model_config_of(bench.bench_config("llmjp4-8b-slice", "peer-mcore-bf16", 8))
    assert mcore_layer_shape(config) == dict(
        num_layers=4, hidden_size=4096, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=14336,
        kv_channels=128, layernorm_epsilon=1e-6, init_method_std=0.02, qk_layernorm=False)
    assert mcore_model_args(config, 4096) == dict(
        vocab_size=196608, max_sequence_length=4096, position_embedding_type="rope", rotary_base=500000,
        share_embeddings_and_output_weights=False)


@pytest.mark.timeout(300)
def test_megatron_core_builds_the_llmjp4_shape_as_ours():
    """Megatron-Core's GPTModel (its local layer spec, on the CPU) from the peer's arguments at the LLM-jp-4 8B's
    vocabulary, RoPE base, eps and GQA ratio, narrowed to one layer of hidden 256: as many parameters as ours, the
    head a tensor of its own."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from llmjp_ds.bench.peers import mcore_layer_shape, mcore_model_args
    from llmjp_ds.model import LlamaForCausalLM
    from llmjp_ds.model.shapes import model_config

    config = model_config("llmjp4-8b", num_layers=1, hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                          ffn_hidden_size=896)
    d = config.head_dim
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        tcfg = TransformerConfig(**mcore_layer_shape(config), normalization="RMSNorm", gated_linear_unit=True,
                                 activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True,
                                 perform_initialization=False)
        gpt = GPTModel(tcfg, get_gpt_layer_local_spec(normalization="RMSNorm"), **mcore_model_args(config, 4096))
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    shapes = {name: tuple(p.shape) for name, p in gpt.named_parameters()}
    assert shapes["embedding.word_embeddings.weight"] == shapes["output_layer.weight"] == (196608, 256)
    assert gpt.output_layer.weight is not gpt.embedding.word_embeddings.weight
    assert shapes["decoder.layers.0.self_attention.linear_qkv.weight"] == ((8 + 2 * 2) * d, 256)  # GQA, 2 groups
    assert shapes["decoder.layers.0.mlp.linear_fc1.weight"] == (2 * 896, 256)  # gate and up
    assert gpt.rotary_pos_emb.inv_freq[1].item() == pytest.approx(500000.0 ** (-2 / d), rel=1e-6)
    assert gpt.decoder.final_layernorm.eps == 1e-6
    with torch.device("meta"):
        ours = LlamaForCausalLM(config, backend="torch")
    assert sum(p.numel() for p in gpt.parameters()) == sum(p.numel() for p in ours.parameters())


def test_shape_variants_give_one_shape_its_own_variants():
    from llmjp_ds.errors import UserError

    own = ["llmjp4-8b-slice=ours-bf16,peer-mcore-bf16"]
    runs = bench.planned_runs(["172b-slice", "llmjp4-8b-slice"], "ours-bf16,ours-fp8-delayed", own)
    assert runs == [("172b-slice", "ours-bf16"), ("172b-slice", "ours-fp8-delayed"), ("llmjp4-8b-slice", "ours-bf16"),
                    ("llmjp4-8b-slice", "peer-mcore-bf16")]
    assert bench.planned_runs(["172b-slice"], "ours-bf16", own) == [("172b-slice", "ours-bf16")]  # unused there
    last = bench.planned_runs(["llmjp4-8b-slice"], None, own + ["llmjp4-8b-slice=ours-bf16"])
    assert last == [("llmjp4-8b-slice", "ours-bf16")]
    assert bench.planned_runs(["llmjp4-8b-slice"], None) == [("llmjp4-8b-slice", v) for v in bench.DEFAULT_VARIANTS]
    for bad in ("llmjp4-8b-slice", "llmjp4-8b=ours-bf16", "llmjp4-8b-slice=ref-te-layer-bf16"):
        with pytest.raises((UserError, SystemExit)):
            bench.planned_runs(["llmjp4-8b-slice"], None, [bad])


def _device_check_runs(*args: str) -> tuple:
    """The (shape, variant) list of ``run.sh --dry-run bench ARGS``, read with the bench's own parser."""
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "device" / "run.sh"), "--dry-run", "bench", *args],
                          capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "NGPU": "0"})
    assert proc.returncode == 0, proc.stderr
    words = shlex.split(next(line for line in proc.stdout.splitlines() if "llmjp_ds.cli bench" in line))
    a = bench.parser().parse_args(words[words.index("bench") + 1:])
    return bench.planned_runs(a.shapes.split(","), a.variants, a.shape_variants), a


def test_the_device_check_measures_llmjp4_in_bf16_beside_the_other_shapes():
    runs, a = _device_check_runs()
    both = ["ours-bf16", "peer-mcore-bf16", "ours-fp8-delayed", "peer-mcore-fp8-param"]
    assert runs == [(s, v) for s in ("172b-slice", "llmjp3-1.8b") for v in both] + [
        ("llmjp4-8b-slice", "ours-bf16"), ("llmjp4-8b-slice", "peer-mcore-bf16")]
    assert (a.gas, a.steps, a.warmup, a.sets) == (8, 3, 2, [])  # every shape's settings
    assert _device_check_runs("--shapes", "llmjp3-1.8b")[0] == [("llmjp3-1.8b", v) for v in both]


def test_stage_shape_is_one_gpus_share_of_the_172b_tp4_middle_stage():
    """The per-GPU GEMMs of TP4: 96 / 4 query heads and 16 / 4 KV heads of 128, FFN 38464 / 4, hidden whole."""
    from llmjp_ds.config import model_config_of

    full = model_config_of(bench.bench_config("172b-slice", "ours-bf16", 8))
    stage = model_config_of(bench.bench_config("172b-tp4-stage", "ours-bf16", 8))
    assert stage.hidden_size == full.hidden_size and stage.num_hidden_layers == 96 // 16
    assert stage.num_attention_heads * 4 == full.num_attention_heads
    assert stage.num_key_value_heads * 4 == full.num_key_value_heads
    assert stage.intermediate_size * 4 == full.intermediate_size
    assert stage.head_dim == full.hidden_size // full.num_attention_heads == 128


@pytest.mark.timeout(300)
def test_harness_profile_on_cpu_profiles_a_step_of_the_host(harness):
    """``--profile`` off a GPU: the profiled steps run after the timed ones; the host profile finds the trainer's
    step among the cumulative costs, and there are no CUDA kernels to count."""
    r = result_of(harness, "profiled")
    assert r["profile"]["kernels"] == 0 and r["profile"]["categories"] == []
    host = r["host_profile"]
    assert host["wall_ms"] > 0 and host["by_self"] and host["by_cumulative"]
    assert any("train_step" in f["function"] for f in host["by_cumulative"])
    assert "syncs" not in r  # CUDA's sync debug mode needs a GPU
    assert "profile " in bench_profile.profile_table(r)


def test_megatron_core_builds_the_moe_shape_as_ours():
    """Megatron-Core's MoE GPTModel (its local spec, on the CPU) from the peer's arguments for LLM-jp-4's
    32B-A3B, narrowed to two layers of 16 experts with the first layer dense: as many parameters as ours, the
    router 16 x hidden, the experts at the MoE width, the per-head query and key norms, the dense layer at the
    dense width."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from llmjp_ds.bench.peers import mcore_layer_shape, mcore_model_args, mcore_moe_args
    from llmjp_ds.config import load_config
    from llmjp_ds.model import LlamaForCausalLM
    from llmjp_ds.model.shapes import model_config

    cfg = load_config(preset="llmjp4-32b-a3b")
    config = model_config("llmjp4-32b-a3b", num_layers=2, hidden_size=256, num_attention_heads=8,
                          num_key_value_heads=2, head_dim=32, num_experts=16, experts_per_token=4,
                          moe_ffn_hidden_size=64, dense_layers=[0])
    moe = mcore_moe_args(config, cfg)
    assert moe["moe_layer_freq"] == [0, 1]
    # no TE and no CUDA streams on the CPU: the sequential experts and the all-gather dispatcher
    moe.update(moe_grouped_gemm=False, moe_permute_fusion=False, moe_router_fusion=False,
               moe_token_dispatcher_type="allgather")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        tcfg = TransformerConfig(**mcore_layer_shape(config), normalization="RMSNorm", gated_linear_unit=True,
                                 activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True,
                                 perform_initialization=False, **moe)
        spec = get_gpt_decoder_block_spec(tcfg, use_transformer_engine=False, normalization="RMSNorm")
        gpt = GPTModel(tcfg, spec, **mcore_model_args(config, 4096))
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    shapes = {name: tuple(p.shape) for name, p in gpt.named_parameters()}
    assert shapes["decoder.layers.0.mlp.linear_fc1.weight"] == (2 * config.intermediate_size, 256)
    assert shapes["decoder.layers.1.mlp.router.weight"] == (16, 256)
    assert shapes["decoder.layers.1.mlp.experts.local_experts.15.linear_fc1.weight"] == (2 * 64, 256)
    assert shapes["decoder.layers.1.self_attention.q_layernorm.weight"] == (32,)
    with torch.device("meta"):
        ours = LlamaForCausalLM(config, backend="torch")
    assert sum(p.numel() for p in gpt.parameters()) == sum(p.numel() for p in ours.parameters())


def test_a_failed_variant_names_its_exception_not_the_warnings_after_it():
    """The bench's row for a variant whose process failed quotes the exception that ended it, not what torch
    prints at exit after it."""
    from llmjp_ds.bench.run import error_line

    stderr = ("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"x.py\", line 1, in f\n"
              "[rank0]: TypeError: GroupedLinear.forward() missing 1 required positional argument: 'm_splits'\n"
              "[rank0]:[W1204 17:28:06 ProcessGroupNCCL.cpp:1575] Warning: WARNING: destroy_process_group() was "
              "not called before program exit\n")
    assert error_line(stderr) == "TypeError: GroupedLinear.forward() missing 1 required positional argument: 'm_splits'"
    assert error_line("warming up\nerror: llmjp4-moe-slice needs CUDA\n") == "error: llmjp4-moe-slice needs CUDA"
    assert error_line("killed\n") == "killed" and error_line("") == "no output"
    assert error_line("torch.OutOfMemoryError: CUDA out of memory.\nwarning\n").startswith("torch.OutOfMemoryError")
