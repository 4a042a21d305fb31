"""One training setup, said twice: as Megatron-LM's ``pretrain_gpt.py`` arguments and as ``llmjp-ds train``'s.

Both stacks get the same model shape, the same initial weights (one Megatron release checkpoint and one HF
directory written from the same tensors), the same blend, split, seed and sample counts (``data.order: megatron``
reads the windows through megatron-core's own builder), the same AdamW, clipping and LR schedule
(``optim.schedule: megatron``: Megatron's warm-up from 0) and no z-loss, which Megatron-Core does not have.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

APEX_STAND_IN = Path(__file__).resolve().parent / "apex"


@dataclass(frozen=True)
class Setup:
    steps: int = 500
    flip: int = 250  # the FP8 runs (delayed scaling, hybrid) start here, from the BF16 checkpoint of this step
    seq_len: int = 4096
    global_batch: int = 2  # sequences a step (micro-batches of one); run AE's continuations ran at 1
    micro_batch: int = 1
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup: int = 50
    eval_interval: int = 100
    eval_iters: int = 2
    seed: int = 1234  # the data's (Megatron's --seed)
    split: str = "990,9,1"
    init_seed: int = 42


def megatron_env(env=None) -> dict:
    """The environment ``pretrain_gpt.py`` runs in: apex's weight-gradient kernel stood in for, and one CUDA
    connection (Megatron-LM's requirement for ordering its communication before its GEMMs)."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(APEX_STAND_IN), env.get("PYTHONPATH")) if p)
    env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    return env


def _shape_args(config) -> list[str]:
    from llmjp_ds.model.shapes import rope_theta

    heads, groups = config.num_attention_heads, config.num_key_value_heads
    gqa = ["--group-query-attention", "--num-query-groups", str(groups)] if groups != heads else []
    return ["--num-layers", str(config.num_hidden_layers), "--hidden-size", str(config.hidden_size),
            "--ffn-hidden-size", str(config.intermediate_size), "--num-attention-heads", str(heads), *gqa,
            "--kv-channels", str(config.head_dim), "--normalization", "RMSNorm",
            "--norm-epsilon", str(config.rms_norm_eps), "--swiglu", "--untie-embeddings-and-output-weights",
            "--disable-bias-linear", "--position-embedding-type", "rope",
            "--rotary-base", str(int(rope_theta(config))),
            "--attention-dropout", "0", "--hidden-dropout", "0", "--init-method-std", "0.02"]


def megatron_args(setup: Setup, config, blend: list[tuple[float, str]], tokenizer: str, cache: str,
                  load: str, finetune: bool = False, save: str | None = None, exit_at: int | None = None,
                  fp8: bool = False) -> list[str]:
    """``pretrain_gpt.py`` arguments (Megatron-LM core_v0.19). ``load`` with ``finetune``: the initial weights
    only (iteration 0, no optimizer); without: a resume. ``save`` with ``exit_at``: save there and stop. The
    weight gradients accumulate in fp32 inside the GEMMs (Megatron's default), as ours do: its own linear layer
    (the head) needs apex's kernel, which benchmarks/parity/apex/ stands in for."""
    s = setup
    args = [*_shape_args(config),
            "--seq-length", str(s.seq_len), "--max-position-embeddings", str(s.seq_len),
            "--micro-batch-size", str(s.micro_batch), "--global-batch-size", str(s.global_batch),
            "--train-iters", str(s.steps), "--lr", str(s.lr), "--min-lr", str(s.min_lr), "--lr-decay-style", "cosine",
            "--lr-warmup-iters", str(s.warmup), "--lr-decay-iters", str(s.steps), "--weight-decay", "0.1",
            "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--adam-eps", "1e-8", "--clip-grad", "1.0",
            "--bf16", "--use-distributed-optimizer", "--transformer-impl", "transformer_engine",
            "--attention-softmax-in-fp32",
            "--no-create-attention-mask-in-dataloader",
            "--data-path", *[str(x) for w, p in blend for x in (w, p)], "--split", s.split, "--seed", str(s.seed),
            "--data-cache-path", cache, "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", tokenizer,
            "--log-interval", "1", "--eval-interval", str(s.eval_interval), "--eval-iters", str(s.eval_iters),
            "--load", load, "--ckpt-format", "torch_dist"]
    if finetune:
        args += ["--finetune", "--no-load-optim", "--no-load-rng"]
    if save:
        args += ["--save", save, "--save-interval", str(exit_at or s.steps)]
    if exit_at:
        args += ["--exit-interval", str(exit_at)]
    if fp8:  # LLM-jp's FP8 settings (LLMJP.md); Megatron-LM flips by a restart with these flags
        args += ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "1",
                 "--fp8-amax-compute-algo", "most_recent"]
    return args


def ours_sets(setup: Setup, blend: list[tuple[float, str]], tokenizer: str, cache: str, init_hf: str | None,
              fp8_from: int | None = None) -> list[str]:
    """``llmjp-ds train --preset llmjp3-1.8b`` overrides for the same setup; ``fp8_from``: the FP8 phase's first
    step (delayed scaling, hybrid, LLM-jp's amax settings, no calibration: Megatron's restart has none either)."""
    s = setup
    sets = {"data.blend": "[" + ", ".join(f"{w}, {p}" for w, p in blend) + "]", "data.tokenizer": tokenizer,
            "data.order": "megatron", "data.split": "[" + s.split + "]", "data.seed": s.seed,
            "data.seq_len": s.seq_len, "data.cache_dir": cache, "model.z_loss": 0,
            "train.steps": s.steps, "train.global_batch_size": s.global_batch,
            "train.micro_batch_size": s.micro_batch, "train.eval_interval": s.eval_interval,
            "train.eval_batches": s.eval_iters, "optim.lr": s.lr, "optim.min_lr_ratio": s.min_lr / s.lr,
            "optim.warmup_steps": s.warmup, "optim.decay_steps": s.steps, "optim.schedule": "megatron",
            "checkpoint.interval": 0, "checkpoint.save_at_end": "false", "checkpoint.async_save": "false",
            "logging.wandb": "disabled"}
    if init_hf:
        sets["model.init_from_hf"] = init_hf
    if fp8_from is not None:
        sets["precision.phases"] = (
            f"[{{precision: bf16}}, {{precision: fp8, start_step: {fp8_from}, recipe: delayed, fp8_format: hybrid, "
            "amax_history_len: 1, amax_compute_algo: most_recent, calibration_steps: 0}]")
    return [x for key, value in sets.items() for x in ("--set", f"{key}={value}")]
