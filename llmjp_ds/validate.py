"""The one entry point of config validation: :func:`validate_run`, run by ``train`` on every rank and by
``preflight`` on the login node, before any process group, GPU memory or heavy import exists. Every failure is
a :class:`~llmjp_ds.errors.UserError` of one line that names the problem and the fix."""

from __future__ import annotations

import dataclasses
import os
import typing

from llmjp_ds.config import RECOMPUTE_MODES, RunConfig, sequence_parallel_of
from llmjp_ds.errors import did_you_mean, fail
from llmjp_ds.parallel.layout import Layout


def validate_run(cfg: RunConfig, world_size: int | None = None, gpus_per_node: int | None = None) -> Layout:
    """Check ``cfg`` for a job of ``world_size`` ranks (default: ``$WORLD_SIZE``) with ``gpus_per_node`` ranks on
    each node (default: the launcher's ``$LOCAL_WORLD_SIZE``, if any); returns its layout."""
    from llmjp_ds.model.shapes import get_shape, resolve_shape

    shape = get_shape(cfg.model.shape)
    _check_overrides(cfg)
    shape = resolve_shape(shape, cfg.model.overrides)
    layout = Layout.of(cfg, world_size)
    _check_model(cfg, shape)
    _check_tensor_parallel(cfg, shape, gpus_per_node or gpus_per_node_from_env())
    _check_parallel(cfg, layout, shape.num_layers)
    _check_train(cfg)
    _check_logging(cfg)
    from llmjp_ds.precision import AUTO, validate_phases

    validate_phases(cfg.precision, shape.num_layers)
    if any(ph.recipe == AUTO for ph in cfg.precision.phases) and not cfg.train.eval_interval:
        fail("precision.phases: recipe auto chooses by the penalty measured on validation batches: set "
             "train.eval_interval > 0 (and a data.split with a valid share), or name the recipe")
    from llmjp_ds.parallel.ds_config import build_ds_config

    build_ds_config(cfg, layout)  # the DeepSpeed JSON: exists, parses, has no optimizer/scheduler block
    return layout


def _check_overrides(cfg: RunConfig) -> None:
    hints = typing.get_type_hints(type(cfg.model.overrides))
    for key, value in dataclasses.asdict(cfg.model.overrides).items():
        if value is not None and value <= 0:
            fail(f"model.overrides.{key} must be a positive {_plain_type(hints[key])}, got {value!r}")


def _plain_type(annotation) -> str:
    return next(a.__name__ for a in typing.get_args(annotation) if a is not type(None))


def _check_model(cfg: RunConfig, shape) -> None:
    from llmjp_ds.model.backend import BACKENDS

    if cfg.model.backend not in BACKENDS:
        fail(f"model.backend {cfg.model.backend!r} is not one of {', '.join(BACKENDS)}")
    if cfg.data.seq_len is not None and cfg.data.seq_len > shape.seq_len:
        fail(f"data.seq_len={cfg.data.seq_len} exceeds the model's max_position_embeddings {shape.seq_len}: lower "
             "it or set model.overrides.seq_len")
    if cfg.precision.dtype not in ("bf16", "fp32"):
        fail(f"precision.dtype must be bf16 or fp32, got {cfg.precision.dtype!r}")
    if cfg.model.recompute not in RECOMPUTE_MODES:
        fail(f"model.recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {cfg.model.recompute!r}"
             f"{did_you_mean(str(cfg.model.recompute), RECOMPUTE_MODES)}")


def _check_parallel(cfg: RunConfig, layout: Layout, num_layers: int) -> None:
    p, t = cfg.parallel, cfg.train
    if p.zero_stage not in (0, 1, 2, 3):
        fail(f"parallel.zero_stage must be 0, 1, 2 or 3, got {p.zero_stage}")
    if p.pipeline_stages < 1:
        fail(f"parallel.pipeline_stages must be >= 1, got {p.pipeline_stages}")
    if p.pipeline_stages > 1 and p.zero_stage > 1:
        fail(f"ZeRO-{p.zero_stage} cannot be combined with pipeline parallelism (DeepSpeed shards gradients "
             "across micro-batches): use parallel.zero_stage=1 with pipeline_stages > 1")
    method = p.partition_method.lower()
    if method not in ("flops", "parameters", "uniform") and not (method.startswith("type:") and method[5:]):
        fail(f"unknown parallel.partition_method {p.partition_method!r}: use flops, parameters, uniform or "
             "type:<layer class regex>")
    if p.pipeline_stages > num_layers:
        fail(f"parallel.pipeline_stages={p.pipeline_stages} exceeds the model's {num_layers} layers: use at most "
             f"{num_layers} stages")
    if not p.stall_timeout_s > 0:
        fail(f"parallel.stall_timeout_s must be > 0 (seconds without progress before a stalled job ends), got "
             f"{p.stall_timeout_s}")
    for name in ("steps", "global_batch_size", "micro_batch_size"):
        if getattr(t, name) <= 0:
            fail(f"train.{name} must be positive, got {getattr(t, name)}")
    if not layout.fits():
        fail(f"world size {layout.world} is not divisible by tensor_parallel x pipeline_stages = {p.tensor_parallel} "
             f"x {p.pipeline_stages}: launch a multiple of {p.tensor_parallel * p.pipeline_stages} ranks (nodes x "
             "GPUs), or change parallel.tensor_parallel / pipeline_stages")
    if t.global_batch_size % (t.micro_batch_size * layout.data):
        fail(f"train.global_batch_size={t.global_batch_size} is not divisible by micro_batch_size x data parallel "
             f"= {t.micro_batch_size} x {layout.data}: make it a multiple of {t.micro_batch_size * layout.data}")


def gpus_per_node_from_env() -> int | None:
    """Ranks per node as the launcher says (torchrun: LOCAL_WORLD_SIZE; the deepspeed launcher: LOCAL_SIZE)."""
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return None


def _check_tensor_parallel(cfg: RunConfig, shape, gpus_per_node: int | None) -> None:
    tp = cfg.parallel.tensor_parallel
    if tp < 1:
        fail(f"parallel.tensor_parallel must be >= 1, got {tp}")
    if cfg.parallel.sequence_parallel and tp == 1:
        fail("parallel.sequence_parallel shards the sequence over the tensor-parallel group: set "
             "parallel.tensor_parallel > 1, or leave sequence_parallel unset")
    if tp == 1:
        return
    for what, n in (("num_attention_heads", shape.num_attention_heads), ("num_key_value_heads",
                    shape.num_key_value_heads), ("ffn_hidden_size", shape.ffn_hidden_size),
                    ("vocab_size (padded)", shape.vocab_size)):
        if n % tp:
            fail(f"the model's {what} {n} is not divisible by parallel.tensor_parallel={tp}: choose a tensor_parallel "
                 f"that divides it ({', '.join(str(d) for d in (2, 4, 8) if n % d == 0) or 'none of 2, 4, 8'})")
    seq = cfg.data.seq_len or shape.seq_len
    if sequence_parallel_of(cfg) and seq % tp:
        fail(f"sequence parallelism splits the sequence over the TP group: data.seq_len {seq} is not divisible by "
             f"parallel.tensor_parallel={tp}; change one, or set parallel.sequence_parallel=false")
    if gpus_per_node is not None and gpus_per_node % tp:
        fail(f"parallel.tensor_parallel={tp} does not divide the {gpus_per_node} GPUs (slots) of a node: a TP group "
             f"would span two nodes (every GEMM communicates over it); use a tensor_parallel that divides "
             f"{gpus_per_node}")
    if cfg.parallel.zero_stage == 3:
        fail("ZeRO-3 is not supported with tensor parallelism: use parallel.zero_stage=1 (or 2 without a pipeline)")


def _check_train(cfg: RunConfig) -> None:
    t, o = cfg.train, cfg.optim
    if not 0 <= o.min_lr_ratio <= 1 or o.lr <= 0:
        fail(f"optim.lr must be > 0 and optim.min_lr_ratio in [0, 1], got lr={o.lr}, min_lr_ratio={o.min_lr_ratio}")
    if o.warmup_steps < 0:
        fail(f"optim.warmup_steps must be >= 0, got {o.warmup_steps}")
    if len(cfg.data.split) != 2 or any(x < 0 for x in cfg.data.split) or cfg.data.split[0] <= 0:
        fail(f"data.split must be [train, valid] fractions, got {cfg.data.split}")
    if cfg.checkpoint.interval < 0 or t.eval_interval < 0:
        fail(f"checkpoint.interval and train.eval_interval must be >= 0 (0 = off), got {cfg.checkpoint.interval} "
             f"and {t.eval_interval}")
    if not cfg.checkpoint.grace_seconds > 0:
        fail(f"checkpoint.grace_seconds must be > 0 (time allowed for the save after SIGTERM), got "
             f"{cfg.checkpoint.grace_seconds}")
    if t.max_nonfinite_steps < 1:
        fail(f"train.max_nonfinite_steps must be >= 1 (consecutive skipped steps before the run stops), got "
             f"{t.max_nonfinite_steps}")
    if cfg.checkpoint.keep_last < 1:
        fail(f"checkpoint.keep_last must be >= 1, got {cfg.checkpoint.keep_last}")


def _check_logging(cfg: RunConfig) -> None:
    from llmjp_ds.metrics import WANDB_MODES

    if cfg.logging.wandb not in WANDB_MODES:
        fail(f"logging.wandb must be online, offline or disabled, got {cfg.logging.wandb!r}"
             f"{did_you_mean(cfg.logging.wandb, WANDB_MODES)}")
    if cfg.logging.interval < 1:
        fail(f"logging.interval must be >= 1 (log every N steps), got {cfg.logging.interval}")
