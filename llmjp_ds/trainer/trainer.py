"""The Trainer: sets a run up and steps it, holding the pieces (precision, parallel wiring, data, checkpoints,
metrics) and calling them; none of them knows it exists. Its jobs live beside it, a file each."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from llmjp_ds.batch_schedule import BatchSchedule
from llmjp_ds.config import RunConfig, model_config_of, seq_len_of, sequence_parallel_of, stop_signals_of
from llmjp_ds.errors import fail
from llmjp_ds.lr_schedule import lr_schedule
from llmjp_ds.trainer.evaluation import Evaluator
from llmjp_ds.trainer.resuming import Resume
from llmjp_ds.trainer.saving import Checkpointer
from llmjp_ds.trainer.stopping import StopRequest, any_rank_stopping
from llmjp_ds.validate import validate_run


def data_plan(cfg, model_config, blend=None):
    """The data of ``blend`` (default ``data.blend``; ``data/prepare.resolve_data``) under the run's tokenizer,
    split, seed and sample order (under megatron also the test split's size, which Megatron-LM asks its builder
    for)."""
    from llmjp_ds.config import megatron_sample_counts
    from llmjp_ds.data.prepare import resolve_data

    test = megatron_sample_counts(cfg)[2] if cfg.data.order == "megatron" else 0
    d = cfg.data
    return resolve_data(d.blend if blend is None else blend, d.tokenizer, model_config.vocab_size, d.split, d.seed,
                        d.cache_dir, d.order, test)


def run_data(cfg, model_config, seq_len: int, barrier=None):
    """The run's samples phase by phase (``data/phases.RunData``): data.blend from step 0, each of data.phases
    from its start; every blend is opened and checked now, before any process group."""
    from llmjp_ds.config import sample_counts, train_samples
    from llmjp_ds.data.phases import RunData

    plans = [(0, data_plan(cfg, model_config), "run")]
    plans += [(p.start_step, data_plan(cfg, model_config, p.blend), p.count) for p in cfg.data.phases]
    return RunData(plans, BatchSchedule.of(cfg.train), train_samples(cfg), sample_counts(cfg)[1], seq_len, barrier)


@dataclass
class TrainState:
    """The loop's progress; every checkpoint carries it."""

    step: int = 0
    consumed_samples: int = 0
    skipped_in_a_row: int = 0
    skipped_total: int = 0


class Trainer:
    """``Trainer(cfg)`` validates (no process group yet); :meth:`build_engine` starts the process group and builds
    the engine (all ``llmjp-ds bench`` needs); :meth:`setup` adds data, the run directory's lock, resume and
    logging; :meth:`fit` loops, calling the precision controller at its fixed points, watched for a stalled rank."""

    def __init__(self, cfg: RunConfig, world_size: int | None = None):
        # before torch, transformers and DeepSpeed load: a mistake in the config costs seconds, not a job
        self.layout = validate_run(cfg, world_size)
        from llmjp_ds.model.backend import resolve_backend
        from llmjp_ds.precision.controller import PrecisionController
        from llmjp_ds.precision.schedule import PrecisionSchedule

        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.backend = resolve_backend(cfg.model.backend)
        self.model_config = model_config_of(cfg)
        self.seq_len = seq_len_of(cfg, self.model_config)
        self.batches = BatchSchedule.of(cfg.train)
        self.schedule = lr_schedule(cfg.optim, cfg.train.steps, cfg.train.global_batch_size)  # until a resume
        # validates FP8 availability before any process group exists; a phase given in tokens starts at the first
        # step after them
        self.precision = PrecisionSchedule(cfg.precision, self.backend,
                                           lambda tokens: self.batches.step_at(math.ceil(tokens / self.seq_len)))
        self.controller = PrecisionController(self.precision, cfg.precision, event=self._event, say=self._say)
        self.state = TrainState()
        self.ctx = None  # the ParallelContext, once start() ran

    # --- setup ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the process group (once)."""
        from llmjp_ds.parallel.context import ParallelContext

        if self.ctx is None:
            self.ctx = ParallelContext.start(self.layout, sequence_parallel_of(self.cfg), self.cfg.parallel)

    def build_engine(self, model=None) -> None:
        """Build the model (or take ``model``), DeepSpeed's engine and the step runner (starting the process group
        if :meth:`start` has not)."""
        import torch

        from llmjp_ds.drills import with_drills
        from llmjp_ds.model.backend import layers_module
        from llmjp_ds.model.llama import DecoderLayer
        from llmjp_ds.parallel.build import build_model, initialize
        from llmjp_ds.parallel.failure import Watchdog
        from llmjp_ds.parallel.runners import make_runner

        self.start()
        torch.manual_seed(self.cfg.train.seed)  # identical initial weights on every rank
        pipeline_loss = None
        if model is None:
            checkpoint_fn = self.precision.checkpoint_function(layers_module(self.backend).checkpoint)
            model, pipeline_loss = build_model(self.cfg, self.model_config, self.backend, checkpoint_fn,
                                               self.ctx.tp, self.layout)
        self.engine = initialize(self.cfg, model, self.layout, self.ctx.mpu)
        self.ctx.bind(self.engine)
        layers = [m for m in self.engine.module.modules() if isinstance(m, DecoderLayer)]
        for layer in layers:
            layer.self_attention.fused_qkv_rope = self.cfg.model.fused_qkv_rope
            if self.backend == "te":
                layer.fused_residual_norm = self.cfg.model.fused_residual_norm and self.cfg.model.recompute != "full"
                layer.self_attention.core_attention.via_torch = self.cfg.model.attention_core == "cudnn"
        self.precision.attach(self.engine.module, layers, self.model_config.num_hidden_layers,
                              self.ctx.amax_reduction_group, tensor_parallel=self.ctx.tp is not None)
        runner = make_runner(self.engine, self.precision, self.ctx, pipeline_loss)
        self.watchdog = Watchdog(self.cfg.parallel.stall_timeout_s, self.ctx.rank)  # armed by fit()
        runner.beat = self.watchdog.beat
        self.runner = with_drills(runner, self.precision)

    def setup(self, wait_for_run_dir: float = 0.0) -> None:
        """Everything a training run needs, resumed from ``latest`` when the run directory has one
        (``wait_for_run_dir``: seconds to wait for another job that still holds the run directory)."""
        from llmjp_ds import checkpoint
        from llmjp_ds.checkpoint.branch import read_origin
        from llmjp_ds.metrics import MetricsLogger, Throughput
        from llmjp_ds.model.flops import flops_per_token_for

        cfg = self.cfg
        # a `latest` that names no complete checkpoint, or a checkpoint of another model shape, LM head, dtype,
        # sequence length or ZeRO stage fail here, before any process group exists (not in DeepSpeed's load); a run
        # directory we cannot write failed in validate_run
        checkpoint.check_resume(self.run_dir, self.model_config.to_dict(), cfg, self.layout)
        self.data = data = run_data(cfg, self.model_config, self.seq_len, barrier=lambda: self.ctx.barrier())
        # one owner per run directory, before anything is written there: rank 0 takes the lock, the other ranks
        # refuse a directory that another job holds (or wait for it to end)
        self.lock = checkpoint.RunDirLock(self.run_dir)
        if int(os.environ.get("RANK", "0")) == 0:
            self.lock.acquire(wait_s=wait_for_run_dir)
        else:
            self.lock.check_peer(wait_s=wait_for_run_dir)
        if self.lock.waited:  # the holder's last save came after the check above
            checkpoint.check_resume(self.run_dir, self.model_config.to_dict(), cfg, self.layout)
        self.start()
        self.ctx.check_shared_dir(self.run_dir)  # before anything else is written there
        if self.ctx.rank == 0:
            checkpoint.prune_incomplete(self.run_dir)  # what a kill or a failed save left: its disk space back
            data.install_tokenizer(self.run_dir)
        self.build_engine()
        self.resume = Resume(self.run_dir, self.layout, self.model_config.num_hidden_layers, self.ctx, self.engine,
                             self.precision, self.controller, self.watchdog)
        client = self.resume.latest()
        self.state = TrainState(**client.get("train_state", {}))
        if self.resume.tag:
            self.schedule = checkpoint.resumed_schedule(checkpoint.read_marker(self.run_dir, self.resume.tag), cfg)
        # a branch's first start: its own wandb run (the checkpoint's id is the source run's), which says where the
        # branch came from
        origin = read_origin(self.run_dir)
        starts_branch = origin is not None and self.resume.tag == origin["tag"]
        self.logger = MetricsLogger(self.run_dir, wandb_mode=cfg.logging.wandb, project=cfg.logging.project,
                                    run_name=cfg.logging.run_name,
                                    run_id=None if starts_branch else client.get("wandb_run_id"),
                                    config={**cfg.to_dict(), **({"branch": origin} if origin else {})},
                                    resume_step=self.state.step if self.resume.tag else None,
                                    rank=self.ctx.rank)
        if starts_branch:
            self.logger.event(self.state.step, "branch", **{f"from_{k}": v for k, v in origin.items()})
        self.resume.report(self.logger, self.state.step, self.gas_at(self.state.step, self.state.consumed_samples))
        self.evaluator = Evaluator(data.valid_at, self.micro_batches, cfg, self.runner, self.controller,
                                   self.watchdog)
        self.stop = StopRequest(cfg.checkpoint.grace_seconds, self.ctx.rank, self.ctx.launchers, stop_signals_of(cfg),
                                lambda reason: self.lock.mark_stopping(reason, cfg.checkpoint.grace_seconds))
        self.throughput = Throughput(flops_per_token_for(self.model_config, self.seq_len),
                                     cfg.train.global_batch_size * self.seq_len, self.layout.world)
        self.checkpointer = Checkpointer(cfg, self.engine, self.ctx, self.run_dir, checkpoint.CheckpointMeta.for_run(
            cfg, self.model_config, self.layout.data), self.controller, self.logger, self.watchdog, self.state.step,
            self.schedule)

    # --- one step -------------------------------------------------------------------------------------------
    def gas_at(self, step: int, consumed: int) -> int:
        """The micro-batches per rank of ``step``, which starts after ``consumed`` samples."""
        return self.batches.batch(step, consumed) // (self.cfg.train.micro_batch_size * self.layout.data)

    def micro_batches(self, dataset, consumed: int, batch: int):
        """This rank's micro-batches of the global batch of ``batch`` samples from global sample ``consumed``."""
        from llmjp_ds.batching import step_micro_batches

        gas = batch // (self.cfg.train.micro_batch_size * self.ctx.dp_size)
        return step_micro_batches(dataset, consumed, gas, self.cfg.train.micro_batch_size, self.ctx.dp_rank,
                                  self.ctx.dp_size, self.ctx.device)

    def train_step(self, step: int, batches, consumed: int | None = None):
        """One optimizer step at ``step`` (after ``consumed`` samples; default: ``step`` global batches) on this
        rank's ``batches``: the LR and weight decay, the precision of the step, forward and backward of every
        micro-batch, the update. Returns (mean [lm_loss, z_loss] over all ranks as a device tensor, the LR)."""
        from llmjp_ds.optim import set_lr
        from llmjp_ds.parallel.deepspeed_internals import set_global_batch

        consumed = step * self.cfg.train.global_batch_size if consumed is None else consumed
        lr = self.schedule.lr(step, consumed)
        set_lr(self.engine.optimizer, lr, self.schedule.weight_decay(step, consumed))
        batch = sum(len(ids) for ids, _ in batches) * self.ctx.dp_size
        if self.engine.train_batch_size() != batch:  # a ramp or a change: DeepSpeed's accumulation follows
            set_global_batch(self.engine, batch)
        self.precision.begin_step(step)
        parts = self.runner.train_step(batches)
        self.precision.end_step()
        return parts, lr

    def evaluate(self) -> dict:
        """The validation after the current step (:meth:`Evaluator.evaluate`)."""
        return self.evaluator.evaluate(self.state.step)

    def _event(self, step: int, kind: str, **fields) -> None:
        self.logger.event(step, kind, **fields)

    def _say(self, line: str) -> None:
        if self.ctx.rank == 0:
            print(line, flush=True)

    # --- checkpoints ----------------------------------------------------------------------------------------
    def save(self, wait: bool = False) -> str:
        """Checkpoint the current step (:meth:`Checkpointer.save`; ``wait``: committed before returning)."""
        return self.checkpointer.save(self.state, wait)

    def commit_save(self, block: bool) -> None:
        """Commit a background save once every rank's writer is done (``block``: wait for it)."""
        self.checkpointer.commit(self.state.step, block)

    def rollback(self, reason: str) -> None:
        """Back to the checkpoint the precision controller names after a divergence (:meth:`Resume.rollback`)."""
        self.resume.rollback(self.state, reason, self.checkpointer)

    # --- the loop -------------------------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train to ``train.steps`` (or a stop request); returns a summary of the run."""
        from llmjp_ds import checkpoint
        from llmjp_ds.metrics import reset_peak_memory

        reset_peak_memory()
        self.watchdog.arm()
        self.last_loss = float("nan")
        while self.state.step < self.cfg.train.steps:
            if self._loop_step():
                break
        else:
            self.commit_save(block=True)
            if self.cfg.checkpoint.save_at_end and checkpoint.latest_tag(self.run_dir) != checkpoint.tag_for(
                    self.state.step, self.precision.rollbacks):
                self.save(wait=True)
        self.logger.close()
        self.ctx.finish()  # the heartbeat stops before the barrier: a rank that ends is not taken for a lost one
        self.ctx.barrier()
        return {"step": self.state.step, "loss": self.last_loss, "run_dir": str(self.run_dir),
                "rollbacks": self.precision.rollbacks, "skipped_steps": self.state.skipped_total}

    def _loop_step(self) -> bool:
        """One step of the loop with its bookkeeping; True when the run stops here (a stop request)."""
        import torch

        step = self.state.step
        phase = self.controller.before_step(step, lambda: self.evaluator.measure(step))
        t0 = time.perf_counter()
        self.watchdog.beat("data", step)
        consumed = self.state.consumed_samples
        batch = self.batches.batch(step, consumed)
        parts, lr = self.train_step(step, self.micro_batches(self.data.train_at(step), consumed, batch), consumed)
        lm_loss, z_loss = parts.tolist()
        applied = self.runner.step_applied() and math.isfinite(lm_loss)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        step_time = time.perf_counter() - t0
        diverged = self.controller.after_step(step, lm_loss, z_loss, phase)
        if diverged:
            self.rollback(diverged)
            return False
        self.state.step += 1
        self.state.consumed_samples += batch
        self._count_skipped(step, applied)
        self.last_loss = lm_loss
        metrics = {"loss": lm_loss, "z_loss": z_loss, "lr": lr, "grad_norm": self.runner.grad_norm(),
                   "step_time_s": step_time, "global_batch_size": batch,
                   **self._step_metrics(phase, step_time, batch * self.seq_len),
                   **self.checkpointer.take_metrics()}
        return self._after_step(metrics)

    def _count_skipped(self, step: int, applied: bool) -> None:
        if applied:
            self.state.skipped_in_a_row = 0
            return
        self.state.skipped_in_a_row += 1
        self.state.skipped_total += 1
        self.logger.event(step, "skipped_step", reason="non-finite loss or gradients",
                          in_a_row=self.state.skipped_in_a_row)
        if self.state.skipped_in_a_row >= self.cfg.train.max_nonfinite_steps:
            self.save(wait=True)
            fail(f"{self.state.skipped_in_a_row} consecutive steps had non-finite loss or gradients (last: step "
                 f"{step}); a checkpoint was saved. Lower optim.lr or check the data, then resume")

    def _step_metrics(self, phase: dict, step_time: float, tokens: int) -> dict:
        from llmjp_ds.metrics import peak_memory_gib

        return {"peak_memory_gib": peak_memory_gib(), "consumed_samples": self.state.consumed_samples,
                **self.controller.step_metrics(phase), "skipped_steps": self.state.skipped_total,
                **self.throughput.update(step_time, tokens), **self.controller.amax_metrics(self.engine.module)}

    def _after_step(self, metrics: dict) -> bool:
        """Validation, logging and checkpointing after a step; True when a stop request ends the run."""
        from llmjp_ds import checkpoint
        from llmjp_ds.config import save_due
        from llmjp_ds.metrics import format_log_line

        cfg, step = self.cfg, self.state.step
        if cfg.train.eval_interval and step % cfg.train.eval_interval == 0:
            metrics.update(self.evaluate())
        if step % cfg.logging.interval == 0 or step == cfg.train.steps:
            self.logger.log(step, metrics)
            if self.ctx.rank == 0 and cfg.logging.progress:
                print(format_log_line(step, cfg.train.steps, metrics), flush=True)
        stopping = any_rank_stopping(self.stop, self.ctx)
        if stopping or save_due(step, cfg.checkpoint):
            self.save(wait=stopping)
        else:
            self.commit_save(block=False)
        if stopping:
            self.logger.event(step, "preempted", tag=checkpoint.tag_for(step, self.precision.rollbacks),
                              reason=self.stop.reason)
        return stopping
