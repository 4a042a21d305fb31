"""TE's FP8 weight caching (``is_first_microbatch``) driven by one counter instead of call-site flags.

In an FP8 step every GEMM weight is cast (and transposed) to FP8 on each micro-batch, although it cannot change
before the optimizer step: with gradient accumulation 8 that is 8 casts where 1 would do. The schedule owns one
:class:`WeightCache` and, for FP8 runs on TE, hands it to every module that speaks the protocol of
:class:`llmjp_ds.model.weight_reuse.ReusesFP8Weights` (:meth:`~llmjp_ds.precision.schedule.PrecisionSchedule.attach`).
Such a module casts on its first forward after :meth:`WeightCache.weights_changed` and reuses the FP8 copy on
every later forward: the step's other micro-batches, activation-checkpoint recomputes, pipeline micro-batches and
evaluation. The schedule bumps the cache after every optimizer step, checkpoint load and recipe switch.
"""

from __future__ import annotations


class WeightCache:
    """The generation of the weights: it changes whenever they may have changed."""

    def __init__(self):
        self.generation = 0

    def weights_changed(self) -> None:
        self.generation += 1
