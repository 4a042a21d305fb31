"""Named run presets: each a whole :class:`~llmjp_ds.config.schema.RunConfig` (LLM-jp-3's and LLM-jp-4's recipes,
the CPU demo), the base a file and ``--set`` are merged over. A preset's ``model.shape`` names a model shape of
:mod:`llmjp_ds.model.shapes`."""

from __future__ import annotations

from typing import Callable

from llmjp_ds.config.schema import (CheckpointConfig, DataConfig, KeepRule, ModelConfig, OptimConfig,
                                    ParallelConfig, PhaseConfig, PrecisionConfig, RunConfig, TrainConfig)
from llmjp_ds.errors import did_you_mean, fail
from llmjp_ds.model.shapes import overrides_dict


def _preset_demo() -> RunConfig:
    return RunConfig(
        run_dir="runs/demo",
        model=ModelConfig(shape="tiny", backend="auto"),
        data=DataConfig(seq_len=128),
        optim=OptimConfig(lr=3e-3, warmup_steps=20, weight_decay=0.1),
        train=TrainConfig(steps=200, global_batch_size=8, micro_batch_size=8, eval_interval=50),
        parallel=ParallelConfig(zero_stage=1),
        precision=PrecisionConfig(dtype="fp32"),
        checkpoint=CheckpointConfig(interval=50, keep_last=2))


def _preset_llmjp3(size: str, lr: float, gbs: int) -> RunConfig:
    """LLM-jp-3's recipe: AdamW (0.9, 0.95, 1e-8), weight decay 0.1, clip 1.0, 2000 warm-up steps, cosine to
    lr / 10 (Megatron-LM's schedule, as LLM-jp trained with it), z-loss 1e-4, seq 4096, 2.1T tokens."""
    return RunConfig(
        run_dir=f"runs/llmjp3-{size}",
        model=ModelConfig(shape=f"llmjp3-{size}", z_loss=1e-4),
        data=DataConfig(order="megatron"),  # LLM-jp trained with Megatron-LM: its samples, in its order
        optim=OptimConfig(lr=lr, warmup_steps=2000, beta1=0.9, beta2=0.95, eps=1e-8,
                          weight_decay=0.1, clip_grad=1.0, schedule="megatron"),
        train=TrainConfig(global_batch_size=gbs, micro_batch_size=1, steps=2_100_000_000_000 // (gbs * 4096)),
        parallel=ParallelConfig(zero_stage=1),
        precision=PrecisionConfig(dtype="bf16"))


def _preset_172b() -> RunConfig:
    cfg = _preset_llmjp3("172b", 1e-4, 1728)
    # 64 x 8 H100 as LLM-jp's Megatron run: TP4 (sequence parallel) x PP16 x DP8, ZeRO-1, selective recompute;
    # the fastest layout that fits 80 GB (docs/172b-layout.md)
    cfg.parallel = ParallelConfig(zero_stage=1, pipeline_stages=16, tensor_parallel=4)
    cfg.model.recompute = "selective"
    # LLM-jp exp1: BF16, then FP8 hybrid delayed scaling from its iteration-7000 checkpoint on (step 7001 the first)
    cfg.precision.phases = [PhaseConfig(precision="bf16"),
                            PhaseConfig(precision="fp8", start_step=7001, recipe="delayed", fp8_format="hybrid",
                                        amax_history_len=1, amax_compute_algo="most_recent")]
    return cfg


# LLM-jp's log-spaced saves: every step below 10, every 10 below 100, every 100 below 10k, then every 1000
LLMJP_LOG_SPACED = [KeepRule(every=1, below=10), KeepRule(every=10, below=100), KeepRule(every=100, below=10_000),
                    KeepRule(every=1000)]


def _preset_llmjp4(size: str) -> RunConfig:
    """LLM-jp-4's stable run (llm-jp/scripts pretrain/scripts/v4-8b-phase1/base/params.sh): AdamW (0.9, 0.95, 1e-8),
    weight decay 0.1, clip 1.0, LR 3e-4 with min 3e-5, 2000 warm-up steps, then WSD with the decay left out
    (--lr-wsd-decay-iters 1 at 12M iterations: decay branches add it, llmjp-ds branch), global batch 512 of
    micro-batches of 1, seq 4096, BF16 throughout, no z-loss (the v4 arguments pass none), no validation (--split
    1,0,0), distributed optimizer (ZeRO-1), log-spaced saves. The tokenizer (v4, 196,608 pieces) and the corpora
    are the user's: data.tokenizer and data.blend. The 32B's published settings are its shape and TP4; its
    schedule here is the 8B's."""
    return RunConfig(
        run_dir=f"runs/llmjp4-{size}",
        model=ModelConfig(shape=f"llmjp4-{size}", z_loss=0.0),
        data=DataConfig(order="megatron", split=[1.0, 0.0, 0.0]),
        optim=OptimConfig(lr=3e-4, min_lr=3e-5, warmup_steps=2000, decay_steps=None, schedule="megatron",
                          decay_style="WSD", wsd_decay_steps=1, wsd_decay_style="linear", beta1=0.9, beta2=0.95,
                          eps=1e-8, weight_decay=0.1, clip_grad=1.0),
        train=TrainConfig(steps=12_000_000, global_batch_size=512, micro_batch_size=1, eval_interval=0),
        parallel=ParallelConfig(zero_stage=1, tensor_parallel=4 if size == "32b" else 1),
        precision=PrecisionConfig(dtype="bf16"),
        checkpoint=CheckpointConfig(interval=0, keep=list(LLMJP_LOG_SPACED)))


def _preset_llmjp4_moe() -> RunConfig:
    """llm-jp-4-32b-a3b's shape with LLM-jp's MoE training arguments (the v4 MoE params.sh): 128 experts, 8 a
    token, SwiGLU width 960, qk-norm, the aux_loss load balancing at 1e-2 and the router z-loss at 1e-3 (router in
    fp32, dropless), init std 0.006, LR 4e-4 to 4e-5 with 2000 warm-up steps and WSD with the decay left out, BF16.
    The 32B-A3B's own batch and length are not published: the 8B's global batch of 512 and its 12M steps stand in
    (set train.global_batch_size and train.steps to the run's)."""
    cfg = _preset_llmjp4("8b")
    cfg.run_dir = "runs/llmjp4-32b-a3b"
    cfg.model = ModelConfig(shape="llmjp4-32b-a3b", z_loss=0.0, init_std=0.006, moe_aux_loss="aux_loss",
                            moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
    cfg.optim.lr, cfg.optim.min_lr = 4e-4, 4e-5
    return cfg


RUN_PRESETS: dict[str, Callable[[], RunConfig]] = {
    "demo": _preset_demo,
    "llmjp3-1.8b": lambda: _preset_llmjp3("1.8b", 3e-4, 512),
    "llmjp3-3.7b": lambda: _preset_llmjp3("3.7b", 3e-4, 1024),
    "llmjp3-13b": lambda: _preset_llmjp3("13b", 2e-4, 1024),
    "llmjp3-172b": _preset_172b,
    "llmjp4-8b": lambda: _preset_llmjp4("8b"),
    "llmjp4-32b": lambda: _preset_llmjp4("32b"),
    "llmjp4-32b-a3b": _preset_llmjp4_moe,
}


def preset_dict(name: str, source: str = "") -> dict:
    """The run preset ``name`` as a plain dict (the base that files and ``--set`` are merged over); ``source``
    says where the name was given, for the message."""
    if name not in RUN_PRESETS:
        fail(f"unknown run preset {name!r}{source}{did_you_mean(name, RUN_PRESETS)}: choose one of "
             f"{', '.join(RUN_PRESETS)}")
    data = RUN_PRESETS[name]().to_dict()
    data["model"]["overrides"] = overrides_dict(data["model"]["overrides"])
    return data


# --- building a config from dicts -----------------------------------------------------------------------
