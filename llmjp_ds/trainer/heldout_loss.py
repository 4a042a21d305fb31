"""Validation: the mean loss over fixed held-out batches in the precision of the moment. The loop measures it as
often as the precision controller's decisions ask (the validation itself, FP8's penalty on the same batches, each
recipe of ``recipe: auto``): :meth:`Evaluator.decide` drives such a decision with these measurements."""

from __future__ import annotations

from llmjp_ds.data.batching import validation_starts


class Evaluator:
    """The validation batches after a step (this rank's share as ``micro_batches(dataset, first, global_batch)``
    reads them from the valid split of the step's data phase, ``valid_at(step)``, at each global sample
    ``batching.validation_starts`` gives for the run config ``cfg``'s sample order), and their loss through the
    step ``runner``."""

    def __init__(self, valid_at, micro_batches, cfg, runner, watchdog):
        self.valid_at, self.micro_batches, self.order, self.train = valid_at, micro_batches, cfg.data.order, cfg.train
        self.runner, self.watchdog = runner, watchdog

    def batches(self, step: int) -> list:
        """The micro-batches of the validation after ``step`` steps (read once, measured as often as asked)."""
        self.watchdog.beat("evaluation", step)
        t = self.train
        starts = validation_starts(self.order, step, t.eval_interval, t.eval_batches, t.global_batch_size)
        valid = self.valid_at(step)
        return [b for start in starts for b in self.micro_batches(valid, start, t.global_batch_size)]

    def loss(self, batches) -> float:
        """The mean loss over ``batches`` of every rank, in the precision the schedule gives each micro-batch now."""
        return self.runner.eval_loss(batches).item()

    def decide(self, decision, step: int):
        """The result of the precision controller's ``decision`` (:func:`measured`), each loss it asks for measured
        on the validation batches after ``step`` steps (read once)."""
        batches = self.batches(step)
        return measured(decision, lambda: self.loss(batches))


def measured(decision, measure):
    """The result of ``decision``, a generator that yields once per measurement it needs (each time inside the
    precision context of that measurement) and returns its result; ``measure()`` gives each one."""
    try:
        next(decision)
        while True:
            decision.send(measure())
    except StopIteration as done:
        return done.value
