"""The Trainer: one object that sets a run up, steps it, evaluates, saves, rolls back and loops.

It holds the pieces and calls them; none of them knows it exists:

* the precision schedule and its controller (:mod:`llmjp_ds.precision`): the trainer calls the controller before
  each step, after each validation and after each step's loss, and the controller takes every FP8 decision (the
  flip, ``recipe: auto``, FP8's loss penalty and its fallback, the rollback to BF16);
* the parallel wiring (:mod:`llmjp_ds.parallel`): the process groups, the model or pipeline on this rank, the
  DeepSpeed engine and a step runner that hides which engine it is;
* the data (:mod:`llmjp_ds.data`, batches by :mod:`llmjp_ds.batching`), checkpoints (:mod:`llmjp_ds.checkpoint`:
  the run directory's lock, saves with a manifest, a resume from the newest intact tag) and metrics
  (:mod:`llmjp_ds.metrics`).

``Trainer(cfg)`` validates (no process group yet); :meth:`Trainer.build_engine` starts the process group and
builds the engine (all ``llmjp-ds bench`` needs); :meth:`Trainer.setup` does that and adds data, resume (on the
saved layout or, converted once, on another: :mod:`llmjp_ds.parallel.reshape`) and logging; :meth:`Trainer.fit`
runs the loop, with a watchdog that ends a stalled rank (:mod:`llmjp_ds.parallel.failure`).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from llmjp_ds.config import RunConfig, model_config_of, sample_counts, seq_len_of, stop_signals_of
from llmjp_ds.errors import fail
from llmjp_ds.validate import validate_run


def data_plan(cfg, model_config):
    """The run's data (``data/prepare.resolve_data``) from its config: the blend, tokenizer, split, seed and sample
    order (under megatron also the test split's size, which Megatron-LM asks its builder for)."""
    from llmjp_ds.config import megatron_sample_counts
    from llmjp_ds.data.prepare import resolve_data

    test = megatron_sample_counts(cfg)[2] if cfg.data.order == "megatron" else 0
    return resolve_data(cfg.data.blend, cfg.data.tokenizer, model_config.vocab_size, cfg.data.split, cfg.data.seed,
                        cfg.data.cache_dir, cfg.data.order, test)


@dataclass
class TrainState:
    step: int = 0
    consumed_samples: int = 0
    skipped_in_a_row: int = 0
    skipped_total: int = 0


class StopRequest:
    """A stop signal (``checkpoint.stop_signals``, by default SIGTERM and SIGINT), or this rank's launcher gone
    (:mod:`llmjp_ds.parallel.launcher`: the DeepSpeed runner or launch, torchrun's agent): finish the current
    step, save, exit 0. The first request counts; later signals (a scheduler signals the whole process group,
    then DeepSpeed's launch forwards SIGTERM again) change nothing. A timer ends the process if the save takes
    longer than the grace time (the checkpoint being written is then simply not named by ``latest``).
    ``on_request(reason)`` runs once, at the request (rank 0 records in the run directory that it is stopping)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)  # the default of checkpoint.stop_signals

    def __init__(self, grace_seconds: float, rank: int = 0, launchers: list = (), signals=SIGNALS,
                 on_request=None):
        import atexit

        from llmjp_ds.parallel import launcher

        self.requested = False
        self.reason: str | None = None
        self.grace = grace_seconds
        self.rank = rank
        self.signals = tuple(signals)
        self._on_request = on_request
        self._lock = threading.RLock()  # the signal handler (main thread) and the launcher watcher (its thread)
        for sig in self.signals:
            signal.signal(sig, self._handler)
        atexit.register(self._ignore_signals_at_exit)
        self.launcher_watch = launcher.watch(list(launchers), self._launcher_gone)

    def _handler(self, signum, frame):
        self.request(signal.Signals(signum).name)

    def _launcher_gone(self, gone) -> None:
        import sys

        self.request(f"{gone.describe()} is gone")
        try:
            print(f"[llmjp-ds] [rank {self.rank}] {gone.describe()} is gone: stopping as on SIGTERM (a checkpoint at "
                  "the end of this step, then exit)", file=sys.stderr, flush=True)
        except (OSError, ValueError):  # the launcher took our terminal or pipe with it
            pass

    def request(self, reason: str) -> None:
        """Stop at the next step boundary (``reason``: the signal's name, or which launcher is gone)."""
        with self._lock:
            if self.requested:
                return
            self.requested, self.reason = True, reason
        timer = threading.Timer(self.grace, lambda: os._exit(143))
        timer.daemon = True
        timer.start()
        if self._on_request is not None:
            self._on_request(reason)

    def _ignore_signals_at_exit(self) -> None:
        """At interpreter exit (the run saved and ended): ignore the stop signals. CPython's finalization,
        right after the atexit hooks, puts SIG_DFL back for every signal a Python handler holds (it leaves
        SIG_IGN alone), then tears the modules down, ~1 s with torch and DeepSpeed loaded: a second Ctrl-C or a
        launcher's forwarded SIGTERM in that second would end the process by the signal after its save."""
        for sig in self.signals:
            if signal.getsignal(sig) == self._handler:
                signal.signal(sig, signal.SIG_IGN)


class Trainer:
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
        self.tokens_per_step = cfg.train.global_batch_size * self.seq_len
        # validates FP8 availability before any process group exists
        self.precision = PrecisionSchedule(cfg.precision, self.backend, self.tokens_per_step)
        self.controller = PrecisionController(self.precision, cfg.precision, event=self._event, say=self._say)
        self.state = TrainState()
        self.ctx = None  # the ParallelContext, once start() ran

    # --- setup ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the process group (once)."""
        from llmjp_ds.parallel.context import ParallelContext

        from llmjp_ds.config import sequence_parallel_of

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
        self.gas = self.engine.gradient_accumulation_steps()
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
        from llmjp_ds.metrics import MetricsLogger, Throughput
        from llmjp_ds.model.flops import flops_per_token_for

        cfg = self.cfg
        # a `latest` that names no complete checkpoint, or a checkpoint of another model shape, LM head, dtype,
        # sequence length or ZeRO stage fail here, before any process group exists (not in DeepSpeed's load); a run
        # directory we cannot write failed in validate_run
        checkpoint.check_resume(self.run_dir, self.model_config.to_dict(), cfg, self.layout)
        data = data_plan(cfg, self.model_config)
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
        self.train_ds, self.valid_ds = data.build(self.seq_len, *sample_counts(cfg), barrier=self.ctx.barrier)
        client: dict = {}
        reshaped = None
        tag, damaged = checkpoint.choose_intact(self.run_dir, self.ctx)
        if tag:
            marker = checkpoint.read_marker(self.run_dir, tag)
            saved = checkpoint.saved_layout(self.run_dir, tag, marker)
            if saved != self.layout or marker.layout_free:
                client, reshaped = self._reshape(tag, saved), saved
            else:
                client = self._load(tag)
        self.logger = MetricsLogger(self.run_dir, wandb_mode=cfg.logging.wandb, project=cfg.logging.project,
                                    run_name=cfg.logging.run_name, run_id=client.get("wandb_run_id"),
                                    config=cfg.to_dict(), resume_step=self.state.step if tag else None,
                                    rank=self.ctx.rank)
        for bad, reason in damaged:
            self.logger.event(self.state.step, "checkpoint_fallback", damaged=bad, reason=reason, tag=tag)
            if self.ctx.rank == 0:
                print(f"warning: checkpoint {bad} is damaged ({reason}): set aside as {bad}.damaged; resuming from "
                      f"{tag}", file=sys.stderr, flush=True)
        if tag:
            self.logger.event(self.state.step, "resume", tag=tag)
        if reshaped:
            self.logger.event(self.state.step, "reshape", tag=tag, saved=reshaped.name, now=self.layout.name,
                              gradient_accumulation=self.gas)
        self.stop = StopRequest(cfg.checkpoint.grace_seconds, self.ctx.rank, self.ctx.launchers, stop_signals_of(cfg),
                                lambda reason: self.lock.mark_stopping(reason, cfg.checkpoint.grace_seconds))
        self.throughput = Throughput(flops_per_token_for(self.model_config, self.seq_len), self.tokens_per_step,
                                     self.layout.world)
        self.meta = checkpoint.CheckpointMeta.for_run(cfg, self.model_config, self.layout.data)
        self.saver = checkpoint.AsyncSaver() if cfg.checkpoint.async_save else None
        if self.saver is not None:
            from llmjp_ds.checkpoint.async_save import arena_bytes, check_host_memory
            from llmjp_ds.validate import gpus_per_node_from_env

            nbytes = arena_bytes(self.engine.module, self.ctx.dp_rank, self.ctx.dp_size)
            check_host_memory(nbytes, gpus_per_node_from_env() or 1)
            took = self.saver.reserve(nbytes)  # page-locked once here, not in the first save's stall
            self.logger.event(self.state.step, "checkpoint_arena", gib=nbytes / 2**30, seconds=took,
                              pinned=self.saver.arena.pinned)
        self.save_metrics: dict = {}  # the last save's stall and write time, for the next step's record
        self._last_save: tuple[float, int] | None = None  # (perf_counter, step) of the last save's start
        self._interval_told = False  # a save that waited for the previous write said so (once a run)

    # --- one step -------------------------------------------------------------------------------------------
    def micro_batches(self, dataset, consumed: int):
        from llmjp_ds.batching import step_micro_batches

        return step_micro_batches(dataset, consumed, self.gas, self.cfg.train.micro_batch_size, self.ctx.dp_rank,
                                  self.ctx.dp_size, self.ctx.device)

    def train_step(self, step: int, batches):
        """One optimizer step at ``step`` on this rank's ``batches``: the LR, the precision of the step, forward
        and backward of every micro-batch, the update. Returns (mean [lm_loss, z_loss] over all ranks as a
        device tensor, the LR)."""
        from llmjp_ds.optim import schedule_lr, set_lr

        lr = schedule_lr(step, self.cfg.optim, self.cfg.train.steps)
        set_lr(self.engine.optimizer, lr)
        self.precision.begin_step(step)
        parts = self.runner.train_step(batches)
        self.precision.end_step()
        return parts, lr

    def evaluate(self) -> dict:
        """The validation after the current step: its losses (``valid_loss``, and in an FP8 phase the BF16
        reference and FP8's penalty) and what the precision controller decides on them."""
        return self.controller.validation(self.state.step, self._validation())

    def _validation(self, step: int | None = None):
        """The function measuring the mean validation loss over ``eval_batches`` global batches in the precision
        the schedule gives each micro-batch now (the batches read once)."""
        self.watchdog.beat("evaluation", step)
        from llmjp_ds.batching import validation_starts

        t = self.cfg.train
        batches = [b for start in validation_starts(self.cfg.data.order, self.state.step, t.eval_interval,
                                                    t.eval_batches, t.global_batch_size)
                   for b in self.micro_batches(self.valid_ds, start)]
        return lambda: self.runner.eval_loss(batches).item()

    def _event(self, step: int, kind: str, **fields) -> None:
        self.logger.event(step, kind, **fields)

    def _say(self, line: str) -> None:
        if self.ctx.rank == 0:
            print(line, flush=True)

    # --- checkpoints ----------------------------------------------------------------------------------------
    def save(self, wait: bool = False) -> str:
        """Checkpoint the current step. Under ``checkpoint.async_save`` the loop waits only for a save still in
        flight and for the snapshot, and the files are written in the background (``wait``: commit before
        returning, as a stop or the end of the run needs). The stall goes to the next step's metrics."""
        import torch

        from llmjp_ds import checkpoint

        t0 = time.perf_counter()
        self.watchdog.beat("checkpoint")
        pending = self.saver is not None and self.saver.in_flight and not self.saver.done()
        gib = self.saver.snapshot_bytes / 2**30 if pending else 0.0
        self.commit_save(block=True)
        waited = time.perf_counter() - t0
        if pending and self._last_save is not None:
            self._advise_interval(t0, gib, waited)
        self._last_save = (t0, self.state.step)
        client = {"train_state": dict(self.state.__dict__), **self.controller.state_dict(),
                  "wandb_run_id": self.logger.run_id, "rng": torch.get_rng_state()}
        tag = checkpoint.save(self.engine, self.run_dir, self.state.step, client, self.meta,
                              self.cfg.checkpoint.keep_last, rollbacks=self.precision.rollbacks, saver=self.saver)
        self.save_metrics.update(save_stall_s=time.perf_counter() - t0, save_wait_s=waited)
        if wait:
            self.commit_save(block=True)
        return tag

    def _advise_interval(self, now: float, gib: float, waited: float) -> None:
        """The first save that waits for the previous write says why, once, with the numbers (the write's
        GB/s, the interval in seconds, the smallest interval that would not wait); metrics get the event."""
        from llmjp_ds.checkpoint.async_save import interval_advice, smallest_interval

        if self._interval_told:
            return
        self._interval_told = True
        started, step = self._last_save
        steps = max(1, self.state.step - step)
        step_s = (now - started) / steps
        write_s = self.saver.write_s
        self.logger.event(self.state.step, "checkpoint_waited", waited_s=waited, write_s=write_s,
                          snapshot_gib=gib, interval_steps=steps, step_s=step_s,
                          smallest_interval=smallest_interval(write_s, step_s))
        if self.ctx.rank == 0:
            print(f"warning: the checkpoint at step {self.state.step} waited {waited:.1f} s for the previous one: "
                  f"{interval_advice(gib, write_s, steps, step_s)}", file=sys.stderr, flush=True)

    def commit_save(self, block: bool) -> None:
        """Commit a background save once every rank's writer is done (``block``: wait for it)."""
        from llmjp_ds import checkpoint

        saver = self.saver
        if saver is None or not saver.in_flight:
            return
        self.watchdog.beat("checkpoint")
        tag, gib = saver.tag, saver.snapshot_bytes / 2**30
        if checkpoint.commit_when_done(saver, self.ctx, self.run_dir, self.meta, self.cfg.checkpoint.keep_last,
                                       block):
            self.save_metrics["checkpoint_write_s"] = saver.write_s
            self.logger.event(self.state.step, "checkpoint_committed", tag=tag, write_s=saver.write_s,
                              snapshot_gib=gib, write_gib_per_s=gib / max(saver.write_s, 1e-9))

    def _load(self, tag: str) -> dict:
        from llmjp_ds import checkpoint

        client = checkpoint.load(self.engine, self.run_dir, tag)
        self.state = TrainState(**client["train_state"])
        self.controller.load_state_dict(client)
        return client

    def _reshape(self, tag: str, saved) -> dict:
        """Resume checkpoint ``tag`` of another layout: rank 0 converts it once (``parallel.reshape``), every
        rank reads its parameters from the conversion."""
        from llmjp_ds import checkpoint
        from llmjp_ds.parallel.deepspeed_internals import set_progress
        from llmjp_ds.parallel.reshape import CONVERTED, convert, load_converted

        n = self.model_config.num_hidden_layers
        def extra_states() -> dict:
            state = checkpoint.read_model_state(self.run_dir, tag, checkpoint.read_marker(self.run_dir, tag))
            return {k: v for k, v in state.items() if k.endswith("_extra_state")}

        if self.ctx.rank == 0:
            convert(checkpoint.checkpoint_dir(self.run_dir) / tag, n, extra_states, saved,
                    checkpoint.load_checkpoint_file)
        self.ctx.barrier()
        with checkpoint.trusted_te_extra_state():  # TE unpickles FP8 state that the safe reader vetted
            load_converted(self.engine, checkpoint.checkpoint_dir(self.run_dir) / tag / CONVERTED, n,
                           checkpoint.load_checkpoint_file, self.ctx.tp)
        self.precision.weights_changed()
        client = checkpoint.read_client_state(self.run_dir, tag)
        self.state = TrainState(**client["train_state"])
        self.controller.load_state_dict(client)
        set_progress(self.engine, self.state.step, self.state.consumed_samples)
        return client

    def rollback(self, reason: str) -> None:
        """Back to the checkpoint the precision controller names after a divergence; on as it says (BF16)."""
        from llmjp_ds import checkpoint

        self.watchdog.beat("checkpoint")  # loading the good checkpoint
        self.commit_save(block=True)  # a background save of the diverging timeline lands first, then is discarded
        failed_step = self.state.step
        good_step, good_tag = self.controller.rollback_target(failed_step, reason,
                                                              checkpoint.complete_tags(self.run_dir))
        loaded = checkpoint.load(self.engine, self.run_dir, good_tag)
        self.state.__dict__.update(loaded["train_state"])
        self.controller.rolled_back(failed_step, good_step, good_tag, reason, loaded)
        self.save(wait=True)
        if self.ctx.rank == 0:
            checkpoint.discard_after(self.run_dir, good_step)
        self.ctx.barrier()

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
        phase = self.controller.before_step(step, lambda: self._validation(step))
        t0 = time.perf_counter()
        self.watchdog.beat("data", step)
        parts, lr = self.train_step(step, self.micro_batches(self.train_ds, self.state.consumed_samples))
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
        self.state.consumed_samples += self.cfg.train.global_batch_size
        self._count_skipped(step, applied)
        self.last_loss = lm_loss
        metrics = {"loss": lm_loss, "z_loss": z_loss, "lr": lr, "grad_norm": self.runner.grad_norm(),
                   "step_time_s": step_time, **self._step_metrics(phase, step_time), **self.save_metrics}
        self.save_metrics = {}
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

    def _step_metrics(self, phase: dict, step_time: float) -> dict:
        from llmjp_ds.metrics import peak_memory_gib

        return {"peak_memory_gib": peak_memory_gib(), "consumed_samples": self.state.consumed_samples,
                **self.controller.step_metrics(phase), "skipped_steps": self.state.skipped_total,
                **self.throughput.update(step_time), **self.controller.amax_metrics(self.engine.module)}

    def _after_step(self, metrics: dict) -> bool:
        """Validation, logging and checkpointing after a step; True when a stop request ends the run."""
        from llmjp_ds import checkpoint
        from llmjp_ds.metrics import format_log_line

        cfg, step = self.cfg, self.state.step
        if cfg.train.eval_interval and step % cfg.train.eval_interval == 0:
            metrics.update(self.evaluate())
        if step % cfg.logging.interval == 0 or step == cfg.train.steps:
            self.logger.log(step, metrics)
            if self.ctx.rank == 0 and cfg.logging.progress:
                print(format_log_line(step, cfg.train.steps, metrics), flush=True)
        stopping = self.ctx.any_rank(self.stop.requested)
        if stopping and not self.stop.requested:  # another rank's signal: this one's grace timer and record too
            self.stop.request("a stop request on another rank")
        if stopping or (cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0):
            self.save(wait=stopping)
        else:
            self.commit_save(block=False)
        if stopping:
            self.logger.event(step, "preempted", tag=checkpoint.tag_for(step, self.precision.rollbacks),
                              reason=self.stop.reason)
        return stopping
