"""The Trainer: a run set up whole when it is built (data, the run directory's lock, the model under DeepSpeed, the
resumed checkpoint, logging, the monitors) and its loop. The loop asks the precision controller and the health
monitor at fixed points and acts on their answers: it measures what they ask for, skips, rolls back, saves, stops.
None of the pieces knows it exists; its jobs live beside it, a file each."""

from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from llmjp_ds import checkpoint
from llmjp_ds.data.batch_schedule import BatchSchedule, step_index
from llmjp_ds.data.batching import skip_window, skipped, step_micro_batches
from llmjp_ds.checkpoint.branch import read_origin
from llmjp_ds.checkpoint.client_state import ClientState
from llmjp_ds.config import (RunConfig, megatron_sample_counts, model_config_of, sample_counts, save_due,
                             seq_len_of, sequence_parallel_of, stop_signals_of, train_samples)
from llmjp_ds.data.phases import RunData
from llmjp_ds.data.plan import resolve_data
from llmjp_ds.errors import fail
from llmjp_ds.health.monitor import HealthMonitor, Verdict
from llmjp_ds.optim.lr_schedule import plan_line, run_schedule
from llmjp_ds.metrics.experts import routing_metrics, starved_experts
from llmjp_ds.metrics.logger import MetricsLogger, Throughput, format_log_line, peak_memory_gib, reset_peak_memory
from llmjp_ds.model.backend import resolve_backend
from llmjp_ds.model.flops import flops_per_token_for
from llmjp_ds.parallel.context import ParallelContext
from llmjp_ds.parallel.layout import Layout
from llmjp_ds.precision.controller import PrecisionController
from llmjp_ds.trainer import ending
from llmjp_ds.trainer.heldout_loss import Evaluator
from llmjp_ds.trainer.restore import Resume
from llmjp_ds.trainer.saving import Checkpointer
from llmjp_ds.trainer.step import StepEngine, precision_schedule
from llmjp_ds.trainer.stopping import StopRequest, any_rank_stopping


def data_plan(cfg, model_config, blend=None):
    """The data of ``blend`` (default ``data.blend``; ``data/prepare.resolve_data``) under the run's tokenizer,
    split, seed and sample order (under megatron also the test split's size, which Megatron-LM asks its builder
    for)."""
    test = megatron_sample_counts(cfg)[2] if cfg.data.order == "megatron" else 0
    d = cfg.data
    return resolve_data(d.blend if blend is None else blend, d.tokenizer, model_config.vocab_size, d.split, d.seed,
                        d.cache_dir, d.order, test)


def run_data(cfg, model_config, seq_len: int, barrier=None) -> RunData:
    """The run's samples phase by phase: data.blend from step 0, each of data.phases from its start; every blend is
    opened and checked now, before any process group."""
    plans = [(0, data_plan(cfg, model_config), "run")]
    plans += [(step_index(p.start_step), data_plan(cfg, model_config, p.blend), p.count) for p in cfg.data.phases]
    return RunData(plans, BatchSchedule.of(cfg.train), train_samples(cfg), sample_counts(cfg)[1], seq_len, barrier)


@dataclass
class TrainState:
    """The loop's progress; every checkpoint carries it."""

    step: int = 0
    consumed_samples: int = 0  # read by steps, trained or skipped
    skipped_in_a_row: int = 0  # non-finite steps in a row
    skipped_total: int = 0  # steps whose update was skipped: the LR schedule does not advance over them
    skipped_samples: int = 0  # their samples
    rollbacks: int = 0  # checkpoints after a rollback carry -rN in their tags
    skip_steps: list = field(default_factory=list)  # the step ranges [first, last] rollbacks skipped

    def advance(self, batch: int, trained: bool) -> None:
        """One step read (``batch`` samples consumed); one not ``trained`` leaves the LR schedule where it was."""
        self.step, self.consumed_samples = self.step + 1, self.consumed_samples + batch
        if not trained:
            self.skipped_total, self.skipped_samples = self.skipped_total + 1, self.skipped_samples + batch

    @property
    def number(self) -> int:
        """The number of the step to run next (steps are numbered from 1, as the records show them)."""
        return self.step + 1

    def skipped_ranges(self, configured) -> list:
        """The step ranges ``[first, last]`` whose samples the run reads and does not train on: ``configured``
        (train.skip_steps) and its rollbacks'."""
        return [list(r) for r in configured] + [list(r) for r in self.skip_steps]

    def schedule_position(self) -> tuple[int, int]:
        """(steps, samples) the LR schedule has advanced over: the updates made."""
        return self.step - self.skipped_total, self.consumed_samples - self.skipped_samples


def open_logger(cfg: RunConfig, client: ClientState, resumed_tag: str | None, step: int, rank: int,
                guard, finetune=None) -> MetricsLogger:
    """The run's metrics log and wandb run: the resumed checkpoint's, or for a branch's first start a run of its own
    whose config (and first event) says where the branch came from; a fine-tune start's (``finetune``:
    :func:`check_start`) first event and line say where its weights came from. ``guard``: called before each write
    (the run directory's lock, :meth:`checkpoint.RunDirLock.check_in_place`)."""
    origin = read_origin(cfg.run_dir)
    starts_branch = origin is not None and resumed_tag == origin["tag"]
    logger = MetricsLogger(cfg.run_dir, wandb_mode=cfg.logging.wandb, project=cfg.logging.project,
                           run_name=cfg.logging.run_name, run_id=None if starts_branch else client.wandb_run_id,
                           config={**cfg.to_dict(), **({"branch": origin} if origin else {})}, step=step, rank=rank,
                           guard=guard)
    if starts_branch:
        logger.event(step, "branch", **{f"from_{k}": v for k, v in origin.items()})
    if finetune:
        source, tag, marker = finetune
        logger.event(0, "finetune", run=str(Path(source).resolve()), tag=tag, source_step=marker.step)
        say_on_rank0(rank)(f"[llmjp-ds] a fine-tune start: the weights of {source} {tag} (its step {marker.step}); "
                           "the optimizer, the LR schedule and the data start afresh")
    return logger


def rank_micro_batches(dataset, first: int, batch: int, micro: int, ctx: ParallelContext):
    """This rank's micro-batches (of ``micro`` samples) of a global batch of ``batch`` samples from sample ``first``
    of ``dataset``."""
    return step_micro_batches(dataset, first, batch // (micro * ctx.dp_size), micro, ctx.dp_rank, ctx.dp_size,
                              ctx.device)


def step_record(result, step: int, lr: float, step_time: float, batch: int, state: TrainState, cfg: RunConfig,
                data) -> dict:
    """The record's fields of step ``step``'s values (``result``: :class:`~llmjp_ds.parallel.runners.StepValues`)
    after ``state`` advanced over it: the losses, LR and time, the gradient norm (or that the gate skipped the
    update), the batch and the run's counts, the data phase (``data``'s, when the run has phases), the routing."""
    return {"loss": result.lm_loss, "z_loss": result.z_loss, "lr": lr, "step_time_s": step_time,
            **({"skipped": "loss spike"} if result.gated else {"grad_norm": result.grad_norm}),
            "global_batch_size": batch, "peak_memory_gib": peak_memory_gib(),
            "consumed_samples": state.consumed_samples, "skipped_steps": state.skipped_total,
            **({"data_phase": data.phases.index(data.phase_at(step - 1))} if cfg.data.phases else {}),
            **routing_record(result.routing, step, cfg)}


def routing_record(routing, step: int, cfg: RunConfig) -> dict:
    """An MoE model's routing in step ``step``'s record (the whole load matrix every
    ``logging.expert_load_interval`` steps and at the last); nothing for a dense model."""
    if routing is None:
        return {}
    every = cfg.logging.expert_load_interval
    return routing_metrics(routing, bool(every) and (step % every == 0 or step == cfg.train.steps))


def say_on_rank0(rank: int):
    """A line for people, printed by rank 0."""
    return (lambda line: print(line, flush=True)) if rank == 0 else (lambda line: None)


def check_start(cfg: RunConfig, model_config, layout: Layout):
    """What a run starts from, checked before any process group exists: the checkpoint a resume reads
    (:func:`~llmjp_ds.checkpoint.check_resume`), or for a run's first start, the source of a fine-tune start
    (``model.init_from_checkpoint``): its (run directory, tag, marker), returned; None without one."""
    resumes = checkpoint.check_resume(cfg.run_dir, model_config.to_dict(), cfg, layout)
    if resumes is not None or not cfg.model.init_from_checkpoint:
        return None
    return checkpoint.check_finetune(cfg.model.init_from_checkpoint, model_config.to_dict())


def finetune_weights(finetune) -> dict | None:
    """The whole model's weights of a fine-tune start's source (:func:`check_start`; None: no fine-tune start)."""
    return checkpoint.finetune_weights(*finetune) if finetune else None


class Trainer:
    """A run of ``cfg`` on ``layout`` (``validate_run``'s), resumed from ``latest`` when the run directory has one
    (``wait_for_run_dir``: seconds to wait for another job that still holds it); :meth:`fit` trains it."""

    def __init__(self, cfg: RunConfig, layout: Layout, wait_for_run_dir: float = 0.0):
        self.cfg, self.layout, self.run_dir = cfg, layout, Path(cfg.run_dir)
        self.model_config = model_config_of(cfg)
        self.seq_len = seq_len_of(cfg, self.model_config)
        self.batches = BatchSchedule.of(cfg.train)
        self.data = run_data(cfg, self.model_config, self.seq_len)
        precision = precision_schedule(cfg, resolve_backend(cfg.model.backend))  # FP8's availability, checked
        self._claim_run_dir(wait_for_run_dir)
        with self.lock.undone_on_refusal():  # a start refused from here on leaves the run directory as it was
            self._start_processes()
            with self.ctx.reporting_failures():  # a host gone without a word: named once for the job
                client = self._restore(precision)
                self._start_jobs(precision, client)

    def _claim_run_dir(self, wait_s: float) -> None:
        """One owner per run directory, before anything is written there: rank 0 takes the lock, the other ranks
        refuse a directory that another job holds (or wait for it to end). Then, before any process group exists,
        the checkpoint a resume would read: a ``latest`` that names no complete checkpoint, or one that another
        model, LM head, dtype, sequence length, ZeRO stage, blend or batch history wrote, fails here (and so does a
        fine-tune start's source)."""
        self.lock = checkpoint.RunDirLock(self.run_dir)
        if int(os.environ.get("RANK", "0")) == 0:
            self.lock.acquire(wait_s=wait_s)
        else:
            self.lock.check_peer(wait_s=wait_s)
        with self.lock.undone_on_refusal():
            self.finetune = check_start(self.cfg, self.model_config, self.layout)

    def _start_processes(self) -> None:
        """The process group; every rank sees the same run directory; rank 0 clears what a kill left and puts the
        tokenizer in."""
        self.ctx = ParallelContext.start(self.layout, sequence_parallel_of(self.cfg), self.cfg.parallel)
        with self.ctx.reporting_failures():
            self.ctx.check_shared_dir(self.run_dir)  # before anything else is written there
            self.lock.remember()  # on the other ranks: the lock file rank 0 holds, checked before each save
            if self.ctx.rank == 0:
                checkpoint.prune_incomplete(self.run_dir)  # what a kill or a failed save left: its disk space back
                self.data.install_tokenizer(self.run_dir)
            self.data.barrier = self.ctx.barrier

    def _restore(self, precision) -> ClientState:
        """The model under DeepSpeed, the newest intact checkpoint loaded into it (if any), the train state and
        the LR schedule that go on from there; the checkpoint's client state."""
        cfg = self.cfg
        self.steps = StepEngine(cfg, self.layout, self.ctx, precision, weights=finetune_weights(self.finetune))
        self.resume = Resume(self.run_dir, self.layout, self.model_config.num_hidden_layers, self.ctx,
                             self.steps.engine, precision, self.steps.watchdog,
                             getattr(self.model_config, "num_experts", 0))
        client = ClientState.from_dict(self.resume.latest())
        self.state = TrainState(**client.train_state)
        self.data.train_at(self.state.step)  # a corpus too small for the run is refused here
        marker = checkpoint.read_marker(self.run_dir, self.resume.tag) if self.resume.tag else None
        self.schedule = checkpoint.resumed_schedule(marker, cfg)
        return client

    def _start_jobs(self, precision, client: ClientState) -> None:
        """The record, the precision controller and the health monitor (from ``client``, the checkpoint's state),
        and the loop's jobs: validation, stop requests, throughput, saves."""
        cfg, ctx = self.cfg, self.ctx
        self.logger = open_logger(cfg, client, self.resume.tag, self.state.step, ctx.rank, self.lock.check_in_place,
                                  self.finetune)
        self.say = say_on_rank0(ctx.rank)
        self.say(f"[llmjp-ds] {plan_line(cfg, self.schedule)}")
        self.controller = PrecisionController(precision, cfg.precision, event=self.logger.event, say=self.say)
        self.controller.load_state_dict(client.to_dict())
        self.health = HealthMonitor(cfg.health)
        self.health.load_state_dict(client.health)
        batch = self.batches.batch(self.state.step, self.state.consumed_samples)
        self.resume.report(self.logger, self.state.step, batch // (cfg.train.micro_batch_size * self.layout.data))
        self.micro_batches = functools.partial(rank_micro_batches, micro=cfg.train.micro_batch_size, ctx=ctx)
        self.evaluator = Evaluator(self.data.valid_at, self.micro_batches, cfg, self.steps.runner, self.steps.watchdog)
        self.stop = StopRequest(cfg.checkpoint.grace_seconds, ctx.rank, ctx.launchers, stop_signals_of(cfg),
                                functools.partial(self.lock.mark_stopping, grace_seconds=cfg.checkpoint.grace_seconds))
        self.throughput = Throughput(flops_per_token_for(self.model_config, self.seq_len),
                                     cfg.train.global_batch_size * self.seq_len, self.layout.world)
        self.checkpointer = Checkpointer(cfg, self.steps.engine, ctx, self.run_dir,
                                         checkpoint.CheckpointMeta.for_run(cfg, self.model_config, self.layout.data),
                                         self.logger, self.steps.watchdog, self.state.step, self.lock.check_in_place)
        self.last_loss = float("nan")
        if self.logger.failure:  # the start's events: nothing trained yet, nothing to save
            fail(f"{self.logger.failure}: free space, then start again")

    # --- the loop -------------------------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train to ``train.steps`` (or a stop request); returns a summary of the run."""
        with self.ctx.reporting_failures():
            return self._fit()

    def _fit(self) -> dict:
        reset_peak_memory()
        self.steps.watchdog.arm()
        while self.state.step < self.cfg.train.steps:
            if self._loop_step():
                break
        else:
            self.checkpointer.commit(self.state.step, block=True)
            if self.cfg.checkpoint.save_at_end and checkpoint.latest_tag(self.run_dir) != checkpoint.tag_for(
                    self.state.step, self.state.rollbacks):
                self.save(wait=True)
            if self.logger.failure:  # the last save's events did not fit
                ending.end_on_lost_record(self.logger.failure, lambda: checkpoint.latest_tag(self.run_dir), 0)
        self.logger.close()
        self.ctx.finish()  # the heartbeat stops before the barrier: a rank that ends is not taken for a lost one
        self.ctx.barrier()
        return {"step": self.state.step, "loss": self.last_loss, "run_dir": str(self.run_dir),
                "rollbacks": self.state.rollbacks, "skipped_steps": self.state.skipped_total}

    def _loop_step(self) -> bool:
        """One step and what follows from it; True when the run stops here (a stop request). The step is
        ``s.number`` to the controllers, the events and people, as its record shows it; the batch schedule and the
        data count the ``s.step`` steps before it."""
        s = self.state
        step = s.number
        if self.controller.choice_due(step):
            self.evaluator.decide(self.controller.choose_recipe(step), s.step)
        phase = self.controller.before_step(step)
        t0 = time.perf_counter()
        self.steps.watchdog.beat("data", step)
        batch = self.batches.batch(s.step, s.consumed_samples)
        if skipped(step, s.skipped_ranges(self.cfg.train.skip_steps)):  # read, not trained on: no LR advance
            s.advance(batch, trained=False)
            return False
        sched_step, sched_samples = s.schedule_position()
        lr = self.schedule.lr(sched_step, sched_samples)
        gate = self.health.gate_at(step)
        result = self.steps.train_step(step, self.micro_batches(self.data.train_at(s.step), s.consumed_samples,
                                                                batch),
                                       lr, self.schedule.weight_decay(sched_step, sched_samples), gate).read()
        lm_loss, z_loss = result.lm_loss, result.z_loss
        applied = result.applied and math.isfinite(lm_loss)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        step_time = time.perf_counter() - t0
        if diverged := self.controller.after_step(step, lm_loss, z_loss, phase):
            reason, first_bad = diverged
            good_step, good_tag, client = self.rollback(first_bad, f"loss diverged after the FP8 flip ({reason})")
            self.controller.rolled_back(step, good_step, good_tag, reason, client)
            self.save(wait=True)
            return False
        verdict = self.health.after_step(step, lm_loss, result.grad_norm, applied, result.gated)
        if result.routing is not None:  # counted every step, whatever else the step's verdict is
            collapse = self.health.after_routing(step, starved_experts(result.routing.expert_load))
            verdict = verdict or collapse
        if verdict is not None and self._act(verdict, result.gated):
            return False  # rolled back: the loop goes on from the checkpoint
        if applied:
            s.skipped_in_a_row = 0
        s.advance(batch, trained=applied)
        self.last_loss = lm_loss
        return self._after_step({
            **step_record(result, step, lr, step_time, batch, s, self.cfg, self.data),
            **self.controller.step_metrics(phase), **self.throughput.update(step_time, batch * self.seq_len),
            **self.controller.amax_metrics(self.steps.engine.module), **self.checkpointer.take_metrics()})

    def _act(self, verdict: Verdict, gated: bool) -> bool:
        """The configured action on ``verdict``: an event always; a skipped update counted (the caller), the run
        rolled back (True), or stopped with one line (a rollback over health.max_rollbacks too)."""
        limited = verdict.action == "rollback" and not self.health.rollback_allowed(verdict.step)
        self.logger.event(verdict.step, "health", **verdict.fields(), **({"limit": "health.max_rollbacks"}
                                                                         if limited else {}))
        if verdict.kind == "nonfinite" and verdict.action == "skip":
            self._count_nonfinite(verdict.step)
        elif verdict.action == "skip" and gated:
            self.say(f"[llmjp-ds] {verdict.describe()}: its update skipped")
        elif verdict.action in ("warn", "skip"):
            self.say(f"[llmjp-ds] warning: {verdict.describe()}")
        elif verdict.action == "stop" or limited:
            self.checkpointer.commit(self.state.step, block=True)
            latest = checkpoint.latest_tag(self.run_dir)
            ending.stop(self.logger, verdict.step, ending.rollback_limit_line(verdict, self.cfg.health) if limited
                        else ending.verdict_line(verdict, latest), latest)
        else:
            self._health_rollback(verdict)
            return True
        return False

    def _count_nonfinite(self, step: int) -> None:
        s = self.state
        s.skipped_in_a_row += 1
        self.logger.event(step, "skipped_step", reason="non-finite loss or gradients", in_a_row=s.skipped_in_a_row)
        if s.skipped_in_a_row >= self.cfg.train.max_nonfinite_steps:
            s.advance(self.batches.batch(s.step, s.consumed_samples), trained=False)
            tag = self.save(wait=True)
            ending.stop(self.logger, step, ending.nonfinite_line(s.skipped_in_a_row, step), tag)

    def _health_rollback(self, verdict: Verdict) -> None:
        """Back to the newest checkpoint health.rollback_before steps before ``verdict``'s step, the steps of
        health.skip_before / skip_after around it skipped (recorded in the run's state)."""
        h = self.cfg.health
        skips_before = self.state.skip_steps
        good_step, good_tag, client = self.rollback(verdict.step - h.rollback_before, verdict.describe())
        resumed = ClientState.from_dict(client)
        window = skip_window(good_step, verdict.step, h.skip_before, h.skip_after)
        self.state.skip_steps = [*self.state.skip_steps, window]
        self.health.load_state_dict(resumed.health, keep_rollbacks=True)
        self.controller.load_state_dict(resumed.to_dict())
        self.logger.event(verdict.step, "rollback", reason=verdict.describe(), to_step=good_step, tag=good_tag,
                          skipped_steps=window, kind=verdict.kind, skipped_before=skips_before)
        self.say(f"[llmjp-ds] {verdict.describe()}: rolled back to {good_tag}, steps {window[0]}..{window[1]} "
                 "skipped (their samples not trained on)")
        self.save(wait=True)

    def rollback(self, first_bad_step: int, why: str) -> tuple[int, str, dict]:
        """Back to the newest checkpoint saved before step ``first_bad_step`` ran (``Resume.rollback``): the run's
        state is the checkpoint's, one more rollback counted."""
        rollbacks = self.state.rollbacks + 1
        good_step, good_tag, client = self.resume.rollback(first_bad_step, why, self.checkpointer, self.state.step,
                                                           self.lock.check_in_place)
        self.state = TrainState(**ClientState.from_dict(client).train_state)
        self.state.rollbacks = rollbacks
        self.logger.new_attempt(good_step, "rollback")  # the step records after good_step are superseded
        return good_step, good_tag, client

    def _after_step(self, metrics: dict) -> bool:
        """Validation, logging and checkpointing after a step; True when a stop request ends the run."""
        cfg, step = self.cfg, self.state.step
        if cfg.train.eval_interval and step % cfg.train.eval_interval == 0:
            metrics.update(self.evaluator.decide(self.controller.validation(step), step))
            # the weights of the last step's update: a jump is that step's (or one since the last validation)
            verdict = self.health.after_validation(step, metrics["valid_loss"])
            if verdict is not None and self._act(verdict, False):
                return False
        if step % cfg.logging.interval == 0 or step == cfg.train.steps:
            self.logger.log(step, metrics)
            if cfg.logging.progress:
                self.say(format_log_line(step, cfg.train.steps, metrics))
        stopping, lost = any_rank_stopping(self.stop, self.ctx, self.logger.failure is not None)
        if lost:
            ending.end_on_lost_record(self.logger.failure, lambda: self.save(wait=True), self.ctx.rank)
        if stopping or save_due(step, cfg.checkpoint):
            self.save(wait=stopping)
        else:
            self.checkpointer.commit(self.state.step, block=False)
        if stopping:
            self.logger.event(step, "preempted", tag=checkpoint.tag_for(step, self.state.rollbacks),
                              reason=self.stop.reason)
        return stopping

    def save(self, wait: bool = False) -> str:
        """Checkpoint the current step (``wait``: committed before returning)."""
        s = self.state
        client = ClientState(train_state=asdict(s), **self.controller.state_dict(), health=self.health.state_dict(),
                             wandb_run_id=self.logger.run_id, rng=torch.get_rng_state())
        marker = {"consumed_samples": s.consumed_samples, "skip_steps": s.skipped_ranges(self.cfg.train.skip_steps),
                  "lr_schedule": self.schedule.state_dict(s.schedule_position()[1])}
        return self.checkpointer.save(s.step, client, s.rollbacks, marker, wait)
