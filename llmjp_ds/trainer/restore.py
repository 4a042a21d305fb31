"""Back to a checkpoint: at the start the newest intact one (falling back past damaged ones), on the layout it was
saved on or converted once from another; after a divergence or a spike, the rollback to the newest one before it."""

from __future__ import annotations

import sys

from llmjp_ds import checkpoint
from llmjp_ds.errors import fail
from llmjp_ds.parallel.deepspeed_internals import set_progress
from llmjp_ds.parallel.reshape import CONVERTED, convert, load_converted


class Resume:
    """Loads the checkpoints of ``run_dir`` into the ``engine`` and the ``precision`` schedule; each load returns
    the checkpoint's client state (``checkpoint.client_state``), whose parts the trainer hands to their owners.
    ``num_experts``: an MoE model's (its experts move between ranks when the expert-parallel size changes)."""

    def __init__(self, run_dir, layout, num_layers: int, ctx, engine, precision, watchdog, num_experts: int = 0):
        self.run_dir, self.layout, self.num_layers, self.ctx, self.engine = run_dir, layout, num_layers, ctx, engine
        self.num_experts = num_experts
        self.precision, self.watchdog = precision, watchdog
        self.tag: str | None = None  # the checkpoint the run resumed from
        self.damaged: list[tuple[str, str]] = []  # (tag, why) of each newer checkpoint set aside
        self.reshaped = None  # the layout the checkpoint was saved on, when it was converted to this one

    def latest(self) -> dict:
        """Load the newest intact checkpoint, if any: its client state ({} when the run starts afresh)."""
        client: dict = {}
        tag, self.damaged = checkpoint.choose_intact(self.run_dir, self.ctx)
        if tag:
            marker = checkpoint.read_marker(self.run_dir, tag)
            saved = checkpoint.saved_layout(self.run_dir, tag, marker)
            if saved != self.layout or marker.layout_free:
                client, self.reshaped = self._reshape(tag, saved), saved
            else:
                client = checkpoint.load(self.engine, self.run_dir, tag)
        self.tag = tag
        return client

    def report(self, logger, step: int, gas: int) -> None:
        """The resume's events in the metrics log (``step``: the step resumed at), and a warning per damaged
        checkpoint."""
        for bad, reason in self.damaged:
            logger.event(step, "checkpoint_fallback", damaged=bad, reason=reason, tag=self.tag)
            if self.ctx.rank == 0:
                print(f"warning: checkpoint {bad} is damaged ({reason}): set aside as {bad}.damaged; resuming from "
                      f"{self.tag}", file=sys.stderr, flush=True)
        if self.tag:
            logger.event(step, "resume", tag=self.tag)
        if self.reshaped:
            logger.event(step, "reshape", tag=self.tag, saved=self.reshaped.name, now=self.layout.name,
                         gradient_accumulation=gas)

    def _reshape(self, tag: str, saved) -> dict:
        """Resume checkpoint ``tag`` of another layout: rank 0 converts it once (``parallel.reshape``), every
        rank reads its parameters from the conversion."""
        n = self.num_layers
        def extra_states() -> dict:
            state = checkpoint.read_model_state(self.run_dir, tag, checkpoint.read_marker(self.run_dir, tag))
            return {k: v for k, v in state.items() if k.endswith("_extra_state")}

        if self.ctx.rank == 0:
            convert(checkpoint.checkpoint_dir(self.run_dir) / tag, n, extra_states, saved,
                    checkpoint.load_checkpoint_file, self.num_experts)
        self.ctx.barrier()
        with checkpoint.trusted_te_extra_state():  # TE unpickles FP8 state that the safe reader vetted
            load_converted(self.engine, checkpoint.checkpoint_dir(self.run_dir) / tag / CONVERTED, n,
                           checkpoint.load_checkpoint_file, self.ctx.tp, self.ctx.ep, self.num_experts)
        self.precision.weights_changed()
        client = checkpoint.read_client_state(self.run_dir, tag)
        progress = client["train_state"]
        set_progress(self.engine, progress["step"], progress["consumed_samples"])
        return client

    def rollback(self, first_bad_step: int, why: str, checkpointer=None, step: int = 0,
                 guard=None) -> tuple[int, str, dict]:
        """Load the newest intact checkpoint saved before step ``first_bad_step`` ran (a tag's number counts the
        steps it holds: tag N holds steps 1..N); its step, tag and client state. ``why`` words the line when there
        is none. A background save of the diverging timeline (``checkpointer``'s, after ``step`` steps) lands
        first, and every checkpoint after the good one is discarded (``guard`` called before: the run directory's
        lock, :meth:`checkpoint.RunDirLock.check_in_place`)."""
        if checkpointer is not None:
            checkpointer.commit(step, block=True)
        self.watchdog.beat("checkpoint")  # loading the good checkpoint
        good = [(s, t) for s, t in checkpoint.complete_tags(self.run_dir) if s < first_bad_step]
        if not good:
            fail(f"{why} at step {first_bad_step}, and there is no checkpoint before it to roll back to: lower "
                 "checkpoint.interval so that one is saved before it, or choose another action")
        good_step, good_tag = good[-1]
        client = checkpoint.load(self.engine, self.run_dir, good_tag)
        self.precision.weights_changed()
        if self.ctx.rank == 0:
            if guard is not None:
                guard()
            checkpoint.discard_after(self.run_dir, good_step)
        self.ctx.barrier()
        return good_step, good_tag, client
