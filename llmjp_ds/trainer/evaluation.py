"""Validation: the mean loss over fixed held-out batches in the precision of the moment, measured for the precision
controller, which also measures it with FP8 off (FP8's penalty) and decides on it (``precision/controller.py``)."""

from __future__ import annotations


class Evaluator:
    """The validation loss on the valid split of the step's data phase (``valid_at(step)``; this rank's share as
    ``micro_batches(dataset, consumed, global_batch)`` reads it, from each global sample
    ``batching.validation_starts`` gives for the run config ``cfg``'s sample order), measured through the step
    ``runner`` and handed to the precision ``controller``."""

    def __init__(self, valid_at, micro_batches, cfg, runner, controller, watchdog):
        self.valid_at, self.micro_batches, self.order, self.train = valid_at, micro_batches, cfg.data.order, cfg.train
        self.runner, self.controller, self.watchdog = runner, controller, watchdog

    def evaluate(self, step: int) -> dict:
        """The validation after ``step`` steps: its losses (``valid_loss``, and in an FP8 phase the BF16
        reference and FP8's penalty) and what the precision controller decides on them."""
        return self.controller.validation(step, self.measure(step))

    def measure(self, step: int):
        """The function measuring the mean validation loss over ``eval_batches`` global batches in the precision
        the schedule gives each micro-batch now (the batches read once)."""
        from llmjp_ds.batching import validation_starts

        self.watchdog.beat("evaluation", step)
        t = self.train
        starts = validation_starts(self.order, step, t.eval_interval, t.eval_batches, t.global_batch_size)
        valid = self.valid_at(step)
        batches = [b for start in starts for b in self.micro_batches(valid, start, t.global_batch_size)]
        return lambda: self.runner.eval_loss(batches).item()
