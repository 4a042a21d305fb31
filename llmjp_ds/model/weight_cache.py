"""TE's FP8 weight caching (``is_first_microbatch``) driven by one counter instead of call-site flags.

In an FP8 step every GEMM weight is cast (and transposed) to FP8 on each micro-batch, although it cannot change
before the optimizer step: with gradient accumulation 8 that is 8 casts where 1 would do. While
``WEIGHT_CACHE.enabled``, a module's first forward after :func:`weights_changed` passes
``is_first_microbatch=True`` (cast, and keep the FP8 copy) and every later forward ``False`` (reuse it):
the step's other micro-batches, activation-checkpoint recomputes, pipeline micro-batches and evaluation.
:class:`llmjp_ds.precision.PrecisionSchedule` enables it for FP8 runs on TE and calls :func:`weights_changed`
after every optimizer step and checkpoint load. No TE import here: the logic is tested on CPU.
"""

from __future__ import annotations


class WeightCache:
    enabled = False
    generation = 0


WEIGHT_CACHE = WeightCache()


def weights_changed() -> None:
    WEIGHT_CACHE.generation += 1


class ReusesFP8Weights:
    """Mixin for TE modules whose ``forward(inp, is_first_microbatch=None, ...)`` can cache FP8 weights."""

    _seen_generation: int | None = None

    def forward(self, inp, is_first_microbatch=None, **kwargs):
        if is_first_microbatch is None and WEIGHT_CACHE.enabled:
            is_first_microbatch = self._seen_generation != WEIGHT_CACHE.generation
            self._seen_generation = WEIGHT_CACHE.generation
        return super().forward(inp, is_first_microbatch=is_first_microbatch, **kwargs)
