"""Pretrain (or resume) a run: ``deepspeed llmjp_ds/train.py [--config FILE] [--set key=value ...]``.

Also ``python -m llmjp_ds.train`` and ``llmjp-ds train``. With no arguments it runs the embedded default: the
``demo`` preset (``tiny`` model on the bundled corpus, on CPU if there is no GPU). This file wires the pieces
(config, data, engine, precision schedule, checkpoints, metrics); each lives in its own module.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script by the deepspeed launcher
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmjp_ds.config import RunConfig, load_config, sample_counts, validate, world_size_from_env  # noqa: E402
from llmjp_ds.errors import fail, run_main  # noqa: E402


@dataclass
class TrainState:
    step: int = 0
    consumed_samples: int = 0
    skipped_in_a_row: int = 0
    skipped_total: int = 0


def parse_args(argv):
    p = argparse.ArgumentParser(prog="llmjp-ds train", description=__doc__.splitlines()[0])
    p.add_argument("--config", help="run config (YAML or JSON); may name a preset with `preset:`")
    p.add_argument("--preset", help="run preset: demo, llmjp3-1.8b, llmjp3-3.7b, llmjp3-13b, llmjp3-172b")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set optim.lr=1e-4 (repeatable)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


class StopRequest:
    """SIGTERM/SIGINT: finish the current step, save, exit 0. A watchdog ends the process if the save takes
    longer than the grace time (the checkpoint being written is then simply not named by ``latest``)."""

    def __init__(self, grace_seconds: float):
        self.requested = False
        self.grace = grace_seconds
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        if not self.requested:
            self.requested = True
            timer = threading.Timer(self.grace, lambda: os._exit(143))
            timer.daemon = True
            timer.start()


def _all_ranks_agree(flag: bool, device) -> bool:
    import torch
    import torch.distributed as dist

    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t)
    return bool(t.item() > 0)


def _check_writable(run_dir: Path) -> None:
    """The run directory, or for a new run its nearest existing parent, must be writable; creates nothing."""
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        fail(f"run_dir {run_dir}: {existing} is a file, not a directory; choose another run_dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        fail(f"run_dir {run_dir} is not writable ({existing} is read-only for this user): choose another run_dir "
             "or fix its permissions or mount")


def train(cfg: RunConfig) -> dict:
    """Run the configured training; returns a summary (final step, last loss, run directory)."""
    # first, before torch, transformers and DeepSpeed load: a mistake in the config costs seconds, not a job
    world_size = world_size_from_env()
    validate(cfg, world_size)
    import torch
    import torch.distributed as dist

    from llmjp_ds import checkpoint
    from llmjp_ds.batching import step_micro_batches
    from llmjp_ds.data.prepare import resolve_data
    from llmjp_ds.engine import build_model, data_parallel_info, init_distributed, initialize
    from llmjp_ds.metrics import MetricsLogger, Throughput, format_log_line, peak_memory_gib, reset_peak_memory
    from llmjp_ds.model.backend import resolve_backend
    from llmjp_ds.model.flops import flops_per_token_for
    from llmjp_ds.model.presets import model_config as make_model_config
    from llmjp_ds.optim import schedule_lr, set_lr
    from llmjp_ds.precision import DivergenceGuard, PrecisionSchedule, fp8_summary

    run_dir = Path(cfg.run_dir)
    backend = resolve_backend(cfg.model.backend)
    model_config = make_model_config(cfg.model.preset, **cfg.model.overrides)
    seq_len = cfg.data.seq_len or model_config.max_position_embeddings
    tokens_per_step = cfg.train.global_batch_size * seq_len
    # the schedule validates FP8 availability before any process group exists
    PrecisionSchedule(cfg.precision, backend, tokens_per_step)
    # a run directory we cannot write, a `latest` that names no complete checkpoint, or a checkpoint of another
    # model shape or LM head fail here, before any process group exists (not in DeepSpeed's load, with a traceback)
    _check_writable(run_dir)
    checkpoint.check_resume(run_dir, model_config.to_dict(), cfg.precision.fp8_lm_head)
    data = resolve_data(cfg, model_config, world_rank=int(os.environ.get("RANK", "0")))

    init_distributed()
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
    model, pipe_loss = build_model(cfg, model_config, backend)
    engine = initialize(cfg, model, world_size)
    pipeline = pipe_loss is not None
    dp_rank, dp_size, dp_group = data_parallel_info(engine)
    gas = engine.gradient_accumulation_steps()
    schedule = PrecisionSchedule(cfg.precision, backend, tokens_per_step,
                                 amax_reduction_group=dp_group if pipeline else None)
    decoder_layers = ([m for m in engine.module.modules() if type(m).__name__ == "DecoderLayerPipe"] if pipeline
                      else list(engine.module.model.layers))
    schedule.exempt_layers(decoder_layers, model_config.num_hidden_layers)
    guard = DivergenceGuard(cfg.precision.guard)
    train_ds, valid_ds = data.build(seq_len, *sample_counts(cfg), barrier=dist.barrier)

    state = TrainState()
    client: dict = {}
    tag = checkpoint.latest_tag(run_dir)
    if tag:
        client = checkpoint.load(engine, run_dir, tag)
        state = TrainState(**client["train_state"])
        schedule.load_state_dict(client.get("precision", {}))
        guard.load_state_dict(client.get("guard", {}))
    logger = MetricsLogger(run_dir, wandb_mode=cfg.logging.wandb, project=cfg.logging.project,
                           run_name=cfg.logging.run_name, run_id=client.get("wandb_run_id"),
                           config=cfg.to_dict(), resume_step=state.step if tag else None, rank=rank)
    if tag:
        logger.event(state.step, "resume", tag=tag)
    stop = StopRequest(cfg.checkpoint.grace_seconds)
    throughput = Throughput(flops_per_token_for(model_config, seq_len), tokens_per_step, world_size)
    marker = {"model_config": model_config.to_dict(), "zero_stage": cfg.parallel.zero_stage,
              "pipeline_stages": cfg.parallel.pipeline_stages, "dtype": cfg.precision.dtype, "seq_len": seq_len,
              "fp8_lm_head": cfg.precision.fp8_lm_head}

    def save():
        return checkpoint.save(engine, run_dir, state.step, {
            "train_state": state.__dict__, "precision": schedule.state_dict(), "guard": guard.state_dict(),
            "wandb_run_id": logger.run_id, "rng": torch.get_rng_state()}, marker, cfg.checkpoint.keep_last,
            rollbacks=schedule.rollbacks)

    def run_step(step: int, batches, inject_nan: bool) -> tuple[float, float]:
        """Forward/backward over the micro-batches and the optimizer step; mean (lm_loss, z_loss) over DP.
        ``inject_nan`` (fault drills) makes every micro-batch's loss NaN, so gradients are non-finite too."""
        scale = float("nan") if inject_nan else 1.0
        if pipeline:
            pipe_loss.reset()
            pipe_loss.scale = scale
            engine.module.precision_context = lambda: schedule.autocast(step)
            engine.train_batch(data_iter=iter(batches))
            parts = torch.zeros(2, device=device)
            if engine.is_last_stage():
                parts += torch.stack([torch.as_tensor(pipe_loss.lm_loss_sum, device=device),
                                      torch.as_tensor(pipe_loss.z_loss_sum, device=device)]).float()
                parts /= pipe_loss.micro_batches * dp_size
        else:
            parts = forward_backward(engine, batches, lambda: schedule.autocast(step), scale) / dp_size
        dist.all_reduce(parts)
        lm, z = parts.tolist()
        return lm, z

    def evaluate(step: int) -> float:
        batches = step_micro_batches(valid_ds, 0, gas, cfg.train.micro_batch_size, dp_rank, dp_size, device)
        engine.eval()
        with torch.no_grad():
            if pipeline:
                engine.module.precision_context = lambda: schedule.autocast(step)
                pipe_loss.reset()
                engine.eval_batch(data_iter=iter(batches))
                value = torch.tensor([float(pipe_loss.lm_loss_sum) / max(1, pipe_loss.micro_batches) / dp_size
                                      if engine.is_last_stage() else 0.0], device=device)
            else:
                total = torch.zeros((), device=device)
                for input_ids, targets in batches:
                    with schedule.autocast(step):
                        total += engine(input_ids=input_ids, shift_labels=targets).lm_loss.float()
                value = (total / (gas * dp_size)).reshape(1)
        engine.train()
        schedule.commit_amax()
        dist.all_reduce(value)
        return value.item()

    def rollback(reason: str) -> None:
        # a tag's number counts completed steps: tag N holds the state before step index N ran
        first_bad = guard.first_bad_step if guard.first_bad_step is not None else state.step
        good = [(s, t) for s, t in checkpoint.complete_tags(run_dir) if s <= first_bad]
        if not good:
            fail(f"loss diverged after the FP8 flip ({reason}) and there is no checkpoint before it to roll back "
                 "to: lower checkpoint.interval so one is saved before the flip, or disable the guard")
        good_step, good_tag = good[-1]
        failed_step = state.step
        rollbacks = schedule.rollbacks + 1
        loaded = checkpoint.load(engine, run_dir, good_tag)
        schedule.weights_changed()
        state.__dict__.update(loaded["train_state"])
        guard.load_state_dict(loaded.get("guard", {}))
        schedule.fallback_from_step, schedule.rollbacks = good_step, rollbacks
        logger.event(failed_step, "rollback", reason=reason, to_step=good_step, tag=good_tag, fallback="bf16")
        if rank == 0:
            print(f"[llmjp-ds] FP8 divergence at step {failed_step} ({reason}): rolled back to {good_tag}, "
                  "continuing in BF16", flush=True)
        save()
        if rank == 0:
            checkpoint.discard_after(run_dir, good_step)
        dist.barrier()

    reset_peak_memory()
    last_loss = float("nan")
    while state.step < cfg.train.steps:
        step = state.step
        set_lr(engine.optimizer, lr := schedule_lr(step, cfg.optim, cfg.train.steps))
        phase = schedule.describe(step)
        if schedule.is_flip_step(step):
            logger.event(step, "precision_flip", **phase)
        t0 = time.perf_counter()
        batches = step_micro_batches(train_ds, state.consumed_samples, gas, cfg.train.micro_batch_size,
                                     dp_rank, dp_size, device)
        inject = step in cfg.train.inject_nan_steps and (phase["precision"] == "fp8" or not cfg.train.inject_only_fp8)
        lm_loss, z_loss = run_step(step, batches, inject)
        schedule.end_step()
        applied = engine.was_step_applied() and math.isfinite(lm_loss)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        step_time = time.perf_counter() - t0
        if guard.observe(step, lm_loss + z_loss, phase["precision"]):
            rollback("non-finite loss" if not math.isfinite(lm_loss) else "loss spike")
            continue
        state.step += 1
        state.consumed_samples += cfg.train.global_batch_size
        if applied:
            state.skipped_in_a_row = 0
        else:
            state.skipped_in_a_row += 1
            state.skipped_total += 1
            logger.event(step, "skipped_step", reason="non-finite loss or gradients",
                         in_a_row=state.skipped_in_a_row)
            if state.skipped_in_a_row >= cfg.train.max_nonfinite_steps:
                save()
                fail(f"{state.skipped_in_a_row} consecutive steps had non-finite loss or gradients (last: step "
                     f"{step}); a checkpoint was saved. Lower optim.lr or check the data, then resume")
        last_loss = lm_loss
        metrics = {"loss": lm_loss, "z_loss": z_loss, "lr": lr, "grad_norm": _grad_norm(engine),
                   "step_time_s": step_time, "peak_memory_gib": peak_memory_gib(),
                   "consumed_samples": state.consumed_samples, "phase": phase["recipe"],
                   "precision": phase["precision"], "emulated_fp8": phase["emulated"],
                   "skipped_steps": state.skipped_total, **throughput.update(step_time)}
        if cfg.precision.log_amax:
            metrics.update(fp8_summary(engine.module))
        if cfg.train.eval_interval and state.step % cfg.train.eval_interval == 0:
            metrics["valid_loss"] = evaluate(step)
        if state.step % cfg.logging.interval == 0 or state.step == cfg.train.steps:
            logger.log(state.step, metrics)
            if rank == 0 and cfg.logging.progress:
                print(format_log_line(state.step, cfg.train.steps, metrics), flush=True)
        stopping = _all_ranks_agree(stop.requested, device)
        if stopping or (cfg.checkpoint.interval and state.step % cfg.checkpoint.interval == 0):
            save()
        if stopping:
            logger.event(state.step, "preempted", tag=checkpoint.tag_for(state.step, schedule.rollbacks))
            break
    else:
        if cfg.checkpoint.save_at_end and checkpoint.latest_tag(run_dir) != checkpoint.tag_for(
                state.step, schedule.rollbacks):
            save()
    logger.close()
    dist.barrier()
    return {"step": state.step, "loss": last_loss, "run_dir": str(run_dir), "rollbacks": schedule.rollbacks,
            "skipped_steps": state.skipped_total}


def forward_backward(engine, batches, autocast, scale: float = 1.0):
    """One optimizer step without pipeline parallelism: forward (inside ``autocast()``, the precision schedule's
    per-micro-batch context) and backward for each micro-batch; DeepSpeed applies the optimizer after the last.
    Returns the mean (lm_loss, z_loss) over the micro-batches as a device tensor: nothing in the step waits for
    the GPU. ``scale`` multiplies the loss (NaN in fault drills)."""
    import torch

    parts = None
    for input_ids, targets in batches:
        with autocast():
            out = engine(input_ids=input_ids, shift_labels=targets)
        engine.backward(out.loss * scale)
        engine.step()
        micro = torch.stack([out.lm_loss.detach() * scale, out.z_loss.detach()]).float()
        parts = micro if parts is None else parts + micro
    return parts / len(batches)


def _grad_norm(engine) -> float | None:
    norm = engine.get_global_grad_norm()
    if norm is None:
        return None
    return float(norm.item() if hasattr(norm, "item") else norm)


def shutdown() -> None:
    if "torch.distributed" not in sys.modules:  # failed before torch loaded (a config error): nothing to close
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def cli_main(argv: list[str] | None, verb: str = "train") -> int:
    args = parse_args(argv or [])
    cfg = load_config(args.config, args.sets, args.preset)
    try:
        summary = train(cfg)
    finally:
        shutdown()
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[llmjp-ds] done: step {summary['step']}, loss {summary['loss']:.4f}, run {summary['run_dir']}")
    return 0


def main() -> None:
    run_main(lambda argv: cli_main(argv))


if __name__ == "__main__":
    main()
