"""The model under DeepSpeed's engine on the run's process group, and one optimizer step of it: what a training run
(:class:`~llmjp_ds.trainer.Trainer`) and ``llmjp-ds bench`` share."""

from __future__ import annotations

import math

import torch

from llmjp_ds.data.batch_schedule import BatchSchedule
from llmjp_ds.config import RunConfig, model_config_of, seq_len_of
from llmjp_ds.health.drills import with_drills
from llmjp_ds.model.backend import layers_module, resolve_backend
from llmjp_ds.model.llama import DecoderLayer
from llmjp_ds.model.shapes import moe_layers
from llmjp_ds.optim.adamw import set_lr
from llmjp_ds.parallel.build import build_model, check_stages_hold_experts, initialize
from llmjp_ds.parallel.context import ParallelContext
from llmjp_ds.parallel.deepspeed_internals import set_global_batch
from llmjp_ds.launch.failure import Watchdog
from llmjp_ds.parallel.layout import Layout
from llmjp_ds.parallel.runners import StepResult, make_runner
from llmjp_ds.precision.schedule import PrecisionSchedule


def precision_schedule(cfg: RunConfig, backend: str) -> PrecisionSchedule:
    """The run's precision schedule; a phase given in tokens starts at the first step after them (the batch may
    ramp; steps numbered from 1). Validates FP8's availability, before any process group exists."""
    batches, seq_len = BatchSchedule.of(cfg.train), seq_len_of(cfg, model_config_of(cfg))
    return PrecisionSchedule(cfg.precision, backend, lambda tokens: batches.step_at(math.ceil(tokens / seq_len)) + 1)


class StepEngine:
    """``cfg``'s model (or ``model``; ``weights``: its first weights, a fine-tune start's) under DeepSpeed's engine
    on ``ctx`` (the process groups of ``layout``), its precision schedule attached, and a step runner watched by a
    watchdog (armed by the training loop)."""

    def __init__(self, cfg: RunConfig, layout: Layout, ctx: ParallelContext, precision: PrecisionSchedule,
                 model=None, weights: dict | None = None):
        self.cfg, self.layout, self.ctx, self.precision = cfg, layout, ctx, precision
        self.backend = resolve_backend(cfg.model.backend)
        self.model_config = model_config_of(cfg)
        torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
        pipeline_loss = None
        if model is None:
            checkpoint_fn = precision.checkpoint_function(layers_module(self.backend).checkpoint)
            model, pipeline_loss = build_model(cfg, self.model_config, self.backend, checkpoint_fn, ctx.tp, layout,
                                               ctx.ep, weights)
            check_stages_hold_experts(cfg, model, ctx)
        self.engine = initialize(cfg, model, layout, ctx.mpu, ctx.ep)
        ctx.bind(self.engine)
        layers = [m for m in self.engine.module.modules() if isinstance(m, DecoderLayer)]
        precision.attach(self.engine.module, layers, self.model_config.num_hidden_layers, ctx.amax_reduction_group,
                         tensor_parallel=ctx.tp is not None)
        self.watchdog = Watchdog(cfg.parallel.stall_timeout_s, ctx.rank)
        moe = moe_layers(self.model_config)
        self.runner = with_drills(make_runner(self.engine, precision, ctx, pipeline_loss, self.watchdog.beat,
                                              (len(moe), self.model_config.num_experts) if moe else None), precision)

    def train_step(self, step: int, batches, lr: float, weight_decay: float | None = None, gate=None) -> StepResult:
        """One optimizer step, step ``step`` (numbered from 1), on this rank's ``batches`` with ``lr`` and
        ``weight_decay``: the precision of the step, forward and backward of every micro-batch, the update
        (``gate(loss)``: asked with the step's mean loss before the last backward; True skips the update)."""
        set_lr(self.engine.optimizer, lr, weight_decay)
        batch = sum(len(ids) for ids, _ in batches) * self.ctx.dp_size
        if self.engine.train_batch_size() != batch:  # a ramp or a change: DeepSpeed's accumulation follows
            set_global_batch(self.engine, batch)
        self.precision.begin_step(step)
        result = self.runner.train_step(batches, gate)
        self.precision.end_step()
        return result
