"""The protocol between TE's GEMM modules and the FP8 weight cache, seen from the model's side.

TE casts (and transposes) every GEMM weight to FP8 on each micro-batch unless told ``is_first_microbatch``:
``True`` casts and keeps the FP8 copy, ``False`` reuses it. A module given a cache (``module.weight_cache``: any
object with an integer ``generation`` that changes whenever the weights may have) passes ``True`` on its first
forward of a generation and ``False`` on every later one. The cache itself, and who bumps it, is the precision
package's (:class:`llmjp_ds.precision.weight_cache.WeightCache`): the model only reads ``generation``, so
``model/`` needs nothing from ``precision/``. No TE import here: the logic is tested on CPU.
"""

from __future__ import annotations


class ReusesFP8Weights:
    """Mixin for TE modules whose ``forward(inp, is_first_microbatch=None, ...)`` can cache FP8 weights."""

    weight_cache = None  # an object with ``generation`` (precision.weight_cache.WeightCache), set at attach
    _seen_generation: int | None = None

    def forward(self, inp, is_first_microbatch=None, **kwargs):
        cache = self.weight_cache
        if is_first_microbatch is None and cache is not None:
            is_first_microbatch = self._seen_generation != cache.generation
            self._seen_generation = cache.generation
        return super().forward(inp, is_first_microbatch=is_first_microbatch, **kwargs)
