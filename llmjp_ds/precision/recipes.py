"""The recipes a precision phase may name, the phases themselves, and their checks.

A phase (:class:`Phase`) is ``bf16`` or ``fp8`` from a start step, with a TE recipe (``delayed``, ``current``,
``block``; ``auto`` picks one at the flip, :mod:`llmjp_ds.precision.controller`), its FP8 format and its scaling
settings. :func:`validate_phases` checks the configured list before any process group exists (``validate.py``);
:func:`te_recipe` is TE's recipe object for a phase. A new recipe is a name in :data:`RECIPES`, its TE object in
:func:`te_recipe` and its CPU emulation in :func:`llmjp_ds.precision.emulation._quantize`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from llmjp_ds.errors import fail

RECIPES = ("delayed", "current", "block")
AUTO = "auto"  # the recipe chosen at the flip by measured penalty (precision.controller)
FORMATS = ("hybrid", "e4m3")
PENALTY_ACTIONS = ("warn", "fallback", "bf16")


def validate_phases(cfg, num_layers: int) -> None:
    phases = cfg.phases
    if phases[0].start_step != 1 or phases[0].start_tokens not in (None, 0):
        fail("precision.phases[0] must start at step 1 (it is the precision the run begins in; steps are numbered "
             "from 1, as the progress line shows them)")
    previous = -1
    for i, ph in enumerate(phases):
        where = f"precision.phases[{i}]"
        if ph.precision not in ("bf16", "fp8"):
            fail(f"{where}.precision must be bf16 or fp8, got {ph.precision!r}")
        if ph.recipe not in RECIPES + (AUTO,):
            fail(f"{where}.recipe must be one of {', '.join(RECIPES + (AUTO,))}, got {ph.recipe!r}")
        if not ph.candidates or any(r not in RECIPES for r in ph.candidates):
            fail(f"{where}.candidates must be a non-empty list of {', '.join(RECIPES)}, got {ph.candidates}")
        if any(r not in RECIPES + ("bf16",) for r in ph.fallback):
            fail(f"{where}.fallback must list recipes ({', '.join(RECIPES)}) or bf16, got {ph.fallback}")
        if ph.fp8_format not in FORMATS:
            fail(f"{where}.fp8_format must be hybrid or e4m3, got {ph.fp8_format!r}")
        if ph.amax_compute_algo not in ("max", "most_recent"):
            fail(f"{where}.amax_compute_algo must be max or most_recent, got {ph.amax_compute_algo!r}")
        if ph.amax_history_len < 1 or ph.calibration_steps < 0:
            fail(f"{where}: amax_history_len must be >= 1 and calibration_steps >= 0")
        if ph.start_tokens is None and i and ph.start_step <= previous:
            fail(f"{where}.start_step={ph.start_step} must be after the previous phase's start ({previous})")
        previous = ph.start_step if ph.start_tokens is None else previous
    if cfg.bf16_first_layers + cfg.bf16_last_layers > num_layers:
        fail(f"precision.bf16_first_layers + bf16_last_layers exceeds the model's {num_layers} layers")
    guard = cfg.guard
    if guard.penalty_action not in PENALTY_ACTIONS:
        fail(f"precision.guard.penalty_action must be one of {', '.join(PENALTY_ACTIONS)}, got "
             f"{guard.penalty_action!r}")
    if not guard.max_penalty > 0 or guard.penalty_patience < 1:
        fail(f"precision.guard.max_penalty must be > 0 and penalty_patience >= 1, got {guard.max_penalty} and "
             f"{guard.penalty_patience}")


@dataclass(frozen=True)
class Phase:
    index: int
    precision: str
    start_step: int
    recipe: str = "delayed"
    fp8_format: str = "hybrid"
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    margin: int = 0
    calibration_steps: int = 1
    candidates: tuple = RECIPES
    fallback: tuple = ()

    @property
    def label(self) -> str:
        return "bf16" if self.precision == "bf16" else f"fp8-{self.recipe}-{self.fp8_format}"


@functools.lru_cache(maxsize=None)
def te_recipe(ph: Phase):
    """TE's recipe object for a phase; one per phase (autocast runs per micro-batch)."""
    from transformer_engine.common import recipe as R

    fmt = R.Format.HYBRID if ph.fp8_format == "hybrid" else R.Format.E4M3
    if ph.recipe == "delayed":
        return R.DelayedScaling(fp8_format=fmt, amax_history_len=ph.amax_history_len,
                                amax_compute_algo=ph.amax_compute_algo, margin=ph.margin)
    if ph.recipe == "current":
        return R.Float8CurrentScaling(fp8_format=fmt)
    return R.Float8BlockScaling(fp8_format=R.Format.E4M3 if ph.fp8_format == "e4m3" else fmt)
