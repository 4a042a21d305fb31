"""TE's FP8 weight caching (``is_first_microbatch``) driven by one counter instead of call-site flags.

In an FP8 step every GEMM weight is cast (and transposed) to FP8 on each micro-batch, although it cannot change
before the optimizer step: with gradient accumulation 8 that is 8 casts where 1 would do. A module given a
:class:`WeightCache` (``module.weight_cache``, set by :meth:`llmjp_ds.precision.PrecisionSchedule.attach` for
FP8 runs on TE) passes ``is_first_microbatch=True`` on its first forward after :meth:`WeightCache.weights_changed`
(cast, and keep the FP8 copy) and ``False`` on every later forward (reuse it): the step's other micro-batches,
activation-checkpoint recomputes, pipeline micro-batches and evaluation. The schedule owns the cache and bumps
it after every optimizer step and checkpoint load. No TE import here: the logic is tested on CPU.
"""

from __future__ import annotations


class WeightCache:
    """The generation of the weights: it changes whenever they may have changed."""

    def __init__(self):
        self.generation = 0

    def weights_changed(self) -> None:
        self.generation += 1


class ReusesFP8Weights:
    """Mixin for TE modules whose ``forward(inp, is_first_microbatch=None, ...)`` can cache FP8 weights."""

    weight_cache: WeightCache | None = None
    _seen_generation: int | None = None

    def forward(self, inp, is_first_microbatch=None, **kwargs):
        cache = self.weight_cache
        if is_first_microbatch is None and cache is not None:
            is_first_microbatch = self._seen_generation != cache.generation
            self._seen_generation = cache.generation
        return super().forward(inp, is_first_microbatch=is_first_microbatch, **kwargs)
