"""Saving a run: a checkpoint of the trainer's state (written in the background under ``checkpoint.async_save``),
its commit once every rank's writer is done, and the advice when a save waits for the previous one."""

from __future__ import annotations

import dataclasses
import sys
import time

from llmjp_ds import checkpoint
from llmjp_ds.checkpoint.async_save import (arena_bytes, check_host_memory, interval_advice, seconds,
                                            smallest_interval)
from llmjp_ds.config import kept_step
from llmjp_ds.validate import gpus_per_node_from_env


class Checkpointer:
    """The run's saves into ``run_dir`` (``meta``: the marker's run description). A checkpoint holds the engine and
    the client state the trainer hands each save; what a save stalls the loop for goes to the next step's record
    (:meth:`take_metrics`). ``guard`` is called before a save and a commit write anything (the run directory's
    lock: it ends the run with one line when the directory is no longer the one locked)."""

    def __init__(self, cfg, engine, ctx, run_dir, meta, logger, watchdog, step: int, guard=lambda: None):
        self.cfg, self.engine, self.ctx, self.run_dir, self.meta = cfg, engine, ctx, run_dir, meta
        self.logger, self.watchdog, self.guard = logger, watchdog, guard
        self.saver = checkpoint.AsyncSaver() if cfg.checkpoint.async_save else None
        if self.saver is not None:
            nbytes = arena_bytes(self.engine.module, self.ctx.dp_rank, self.ctx.dp_size)
            check_host_memory(nbytes, gpus_per_node_from_env() or 1)
            took = self.saver.reserve(nbytes)  # page-locked once here, not in the first save's stall
            self.logger.event(step, "checkpoint_arena", gib=nbytes / 2**30, seconds=took,
                              pinned=self.saver.arena.pinned)
        self.save_metrics: dict = {}  # the last save's stall and write time, for the next step's record
        self._last_save: tuple[float, int] | None = None  # (perf_counter, step) of the last save's start
        self._interval_told = False  # a save that waited for the previous write said so (once a run)

    def take_metrics(self) -> dict:
        """The last save's stall and write time, once: they go to the next step's record."""
        metrics, self.save_metrics = self.save_metrics, {}
        return metrics

    def save(self, step: int, client, rollbacks: int, marker: dict, wait: bool = False) -> str:
        """Checkpoint step ``step`` with ``client`` (a ``ClientState``) and ``marker`` (what the marker records of
        the progress: consumed samples, the LR schedule, the samples skipped). Under ``checkpoint.async_save`` the
        loop waits only for a save still in flight and for the snapshot, and the files are written in the background
        (``wait``: commit before returning, as a stop or the end of the run needs). The stall goes to the next
        step's metrics. A step of ``checkpoint.keep``'s rules is marked kept: rotation never deletes it."""
        t0 = time.perf_counter()
        self.watchdog.beat("checkpoint")
        pending = self.saver is not None and self.saver.in_flight and not self.saver.done()
        gib = self.saver.snapshot_bytes / 2**30 if pending else 0.0
        self.commit(step, block=True)
        waited = time.perf_counter() - t0
        if pending and self._last_save is not None:
            self._advise_interval(step, t0, gib, waited)
        self._last_save = (t0, step)
        meta = dataclasses.replace(self.meta, kept=kept_step(step, self.cfg.checkpoint.keep), **marker)
        self.guard()
        tag = checkpoint.save(self.engine, self.run_dir, step, client.to_dict(), meta, self.cfg.checkpoint.keep_last,
                              rollbacks=rollbacks, saver=self.saver)
        self.save_metrics.update(save_stall_s=time.perf_counter() - t0, save_wait_s=waited)
        if wait:
            self.commit(step, block=True)
        return tag

    def _advise_interval(self, step: int, now: float, gib: float, waited: float) -> None:
        """The first save that waits for the previous write says why, once, with what was measured (the write's
        size, GB/s and time, how long the previous save kept the saver busy from its start, the interval in steps and
        seconds) and the smallest interval that would not have waited; metrics get the event."""
        if self._interval_told:
            return
        self._interval_told = True
        started, saved_step = self._last_save
        steps = max(1, step - saved_step)
        step_s = (now - started) / steps
        write_s, busy_s = self.saver.write_s, now - started + waited  # the save's start to its write's end
        self.logger.event(step, "checkpoint_waited", waited_s=waited, write_s=write_s, busy_s=busy_s,
                          snapshot_gib=gib, interval_steps=steps, step_s=step_s,
                          smallest_interval=smallest_interval(busy_s, step_s))
        if self.ctx.rank == 0:
            print(f"warning: the checkpoint at step {step} waited {seconds(waited)} s for the previous one: "
                  f"{interval_advice(gib, write_s, steps, step_s, busy_s)}", file=sys.stderr, flush=True)

    def commit(self, step: int, block: bool) -> None:
        """Commit a background save once every rank's writer is done (``block``: wait for it); ``step``: the
        loop's step now, for the record."""
        saver = self.saver
        if saver is None or not saver.in_flight:
            return
        self.watchdog.beat("checkpoint")
        self.guard()
        tag, gib = saver.tag, saver.snapshot_bytes / 2**30
        if checkpoint.commit_when_done(saver, self.ctx, self.run_dir, self.cfg.checkpoint.keep_last, block):
            self.save_metrics["checkpoint_write_s"] = saver.write_s
            self.logger.event(step, "checkpoint_committed", tag=tag, write_s=saver.write_s,
                              snapshot_gib=gib, write_gib_per_s=gib / max(saver.write_s, 1e-9))
