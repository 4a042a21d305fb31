"""The precision schedule: what each micro-batch runs in, BF16 -> FP8 mid-run with Transformer Engine recipes.

One place answers "what precision does micro-batch m of step s run in": :class:`PrecisionSchedule`, which also
owns all precision state (the FP8 weight cache, the emulator). At setup it is attached to the model once
(:meth:`PrecisionSchedule.attach`); the trainer then marks each step (:meth:`~PrecisionSchedule.begin_step`,
:meth:`~PrecisionSchedule.end_step`) and the step runners wrap every micro-batch's forward in
:meth:`~PrecisionSchedule.micro_batch` (not the whole step: a TE module must not run twice inside one autocast
region). What happens there:

* ``bf16`` phase: nothing, except during the last ``calibration_steps`` BF16 steps before a delayed-scaling FP8
  phase, which run ``te.autocast(enabled=False, calibrating=True)`` so TE records amax histories and the first
  FP8 step already has real scales instead of 1.
* ``fp8`` phase: ``te.autocast(enabled=True, recipe=..., amax_reduction_group=...)``; under pipeline
  parallelism the group is the stage's data-parallel group (the world would hang: stages hold different
  modules). Decoder layers in ``bf16_first_layers`` / ``bf16_last_layers`` run with FP8 disabled; the LM head is
  a plain ``nn.Linear`` in BF16 unless ``precision.fp8_lm_head`` makes it a TE module (``model/llama.py``).
* Without TE (CPU, CI) FP8 phases run as **emulated FP8** when ``precision.emulate_fp8`` is set: each GEMM's
  inputs are cast through ``torch.float8_e4m3fn`` (gradients ``float8_e5m2`` for ``hybrid``) with per-tensor
  scales from the same recipe logic (delayed: amax history; current: this tensor's amax; block: 1x128 tiles).
  The emulated amax histories live in the modules' ``_extra_state`` as float tensors, so checkpoints carry them
  as they carry TE's. Emulation reduces amax per rank (no cross-rank reduction). Layers kept in BF16 get no
  emulator.

The phases and recipes are :mod:`llmjp_ds.precision.recipes`; what watches FP8 once it runs (the divergence
guard, the loss penalty) is :mod:`llmjp_ds.precision.guards`; the decisions taken on what they see (the flip,
``recipe: auto``, a fallback, a rollback to BF16) are :mod:`llmjp_ds.precision.controller`'s.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, replace

import torch

from llmjp_ds.errors import fail
from llmjp_ds.model.backend import te_importable
from llmjp_ds.model.attach import attach_fp8
from llmjp_ds.precision.recipes import AUTO, Phase, te_recipe
from llmjp_ds.precision.weight_cache import WeightCache


def fp8_hardware_available() -> bool:
    if not (torch.cuda.is_available() and te_importable()):
        return False
    return torch.cuda.get_device_capability() >= (8, 9)


class PrecisionSchedule:
    """Phases resolved to start steps (token thresholds become steps: every rank computes the same). Steps are
    numbered from 1, as the config, the progress line and the records number them."""

    def __init__(self, cfg, backend: str, tokens_per_step):
        """``tokens_per_step``: the global batch in tokens, or (a batch that ramps or changes) a function giving the
        first step (its number) that starts after a count of tokens."""
        self.cfg = cfg
        self.backend = backend
        self.amax_reduction_group = None  # set by attach(): the stage's data-parallel group under pipelines
        step_at = tokens_per_step if callable(tokens_per_step) else lambda n: math.ceil(n / tokens_per_step) + 1
        phases = []
        for i, ph in enumerate(cfg.phases):
            start = ph.start_step if ph.start_tokens is None else step_at(ph.start_tokens)
            fields = {k: tuple(v) if isinstance(v, list) else v for k, v in asdict(ph).items()
                      if k in Phase.__dataclass_fields__}
            phases.append(Phase(**{**fields, "index": i, "start_step": start}))
        self.configured = sorted(phases, key=lambda p: p.start_step)
        self.phases = self.configured
        # recipe switches made during the run (the penalty's fallback, recipe: auto): {step, recipe, reason}
        self.switches: list[dict] = []
        self.bf16_reference = False  # inside forced_bf16(): every micro-batch in BF16
        # after a rollback: from this step on every FP8 phase runs in the fallback precision
        self.fallback_from_step: int | None = None
        self.rollbacks = 0
        self.step = 0  # the step the current micro-batches belong to (begin_step)
        uses_fp8 = any(p.precision == "fp8" for p in self.phases)
        self.emulated = uses_fp8 and backend != "te"
        if uses_fp8 and backend == "te" and not fp8_hardware_available():
            if not cfg.emulate_fp8:
                fail("FP8 phases need an sm89+ GPU (Ada, Hopper or newer) with Transformer Engine: this GPU "
                     "cannot run FP8; set precision.emulate_fp8=true to emulate, or remove the fp8 phases")
            self.emulated = True
        if self.emulated and not cfg.emulate_fp8:
            fail("FP8 phases need Transformer Engine on a CUDA GPU (sm89+); on this machine set "
                 "precision.emulate_fp8=true to run them as emulated FP8, or remove the fp8 phases")
        # TE caches each FP8 weight cast for the rest of the step (llmjp_ds.precision.weight_cache)
        self.weight_cache = WeightCache()
        self.caches_weights = backend == "te" and uses_fp8 and not self.emulated and cfg.fp8_weight_cache
        self.emulator = None
        if self.emulated:
            from llmjp_ds.precision.emulation import FP8Emulator

            self.emulator = FP8Emulator()

    # --- which phase ----------------------------------------------------------------------------------
    def scheduled_phase(self, step: int) -> Phase:
        return _in_force(self.phases, step)

    def phase_at(self, step: int) -> Phase:
        ph = self.scheduled_phase(step)
        if ph.precision == "fp8" and self.fallback_from_step is not None and step >= self.fallback_from_step:
            return replace(ph, precision="bf16")
        return ph

    def next_fp8_phase(self, step: int) -> Phase | None:
        for ph in self.phases:
            if ph.start_step > step and ph.precision == "fp8":
                return ph if self.phase_at(ph.start_step).precision == "fp8" else None
        return None

    def calibrating(self, step: int) -> Phase | None:
        """The delayed-scaling FP8 phase whose amax this BF16 step records, if any."""
        if self.phase_at(step).precision != "bf16":
            return None
        nxt = self.next_fp8_phase(step)
        if nxt and nxt.recipe in ("delayed", AUTO) and nxt.start_step - nxt.calibration_steps <= step:
            return nxt
        return None

    def is_flip_step(self, step: int) -> bool:
        return step > 1 and self.phase_at(step).label != self.phase_at(step - 1).label

    def describe(self, step: int) -> dict:
        ph = self.phase_at(step)
        precision = "fp8" if ph.precision == "fp8" else self.cfg.dtype
        return {"precision": precision, "phase": ph.index, "recipe": ph.label if precision == "fp8" else precision,
                "emulated": bool(self.emulated and ph.precision == "fp8"),
                "calibrating": self.calibrating(step) is not None}

    # --- the model and the step --------------------------------------------------------------------------
    def checkpoint_function(self, backend_checkpoint):
        """The activation-checkpoint function the model is built with: under emulation the emulator's, whose
        recompute runs in its forward's FP8 region; else the backend's (TE's restores TE's FP8 context)."""
        return self.emulator.checkpoint if self.emulator is not None else backend_checkpoint

    def attach(self, model, decoder_layers, num_layers: int, amax_reduction_group=None,
               tensor_parallel: bool = False) -> None:
        """Hand the model what FP8 phases need, once, before the first step: the weight cache to TE's GEMM
        modules, the emulator to the torch backend's, and BF16 for the first/last ``bf16_*_layers`` decoder
        layers (by global index, so pipeline stages agree). ``amax_reduction_group``: TE's amax reduction
        group (under pipelines the stage's data-parallel group, under TP its TP x DP group; None = the world);
        under TP the emulator reduces its amax values over it too, as TE does, so a TP slice shares scales."""
        self.amax_reduction_group = amax_reduction_group
        if self.emulator is not None and tensor_parallel:
            self.emulator.reduce_amax_over(amax_reduction_group)
        exempt = set(range(self.cfg.bf16_first_layers))
        exempt |= set(range(num_layers - self.cfg.bf16_last_layers, num_layers))
        exempt_layers = [layer for layer in decoder_layers if layer.self_attention.layer_idx in exempt]
        attach_fp8(model, self.weight_cache if self.caches_weights else None, self.emulator,
                   frozenset(id(m) for layer in exempt_layers for m in layer.modules()))
        if self.emulator is None:
            for layer in exempt_layers:
                _KeptInBF16(layer)

    def begin_step(self, step: int) -> None:
        """The micro-batches that follow belong to ``step`` (training, and the evaluation after it)."""
        self.step = step

    def micro_batch(self):
        """Context for one micro-batch's forward at the current step."""
        return self.autocast(self.step)

    def autocast(self, step: int):
        """Context for one micro-batch's forward at ``step``."""
        ph = self.phase_at(step)
        calib = self.calibrating(step)
        if (ph.precision == "bf16" and calib is None) or self.bf16_reference:
            return contextlib.nullcontext()
        target = ph if ph.precision == "fp8" else calib
        if target.recipe == AUTO:  # calibrating before the choice: record amax as delayed scaling would
            target = replace(target, recipe="delayed")
        if self.emulator is not None:
            return self.emulator.region(target, calibrating=ph.precision == "bf16")
        import transformer_engine.pytorch as te

        return te.autocast(enabled=ph.precision == "fp8", calibrating=ph.precision == "bf16",
                           recipe=te_recipe(target), amax_reduction_group=self.amax_reduction_group)

    def end_step(self) -> None:
        """Called after each optimizer step: emulated delayed scaling commits the step's amax values here, so a
        checkpoint taken between steps holds the complete history (TE keeps its own in ``fp8_meta``)."""
        self.weights_changed()
        self.commit_amax()

    def commit_amax(self) -> None:
        """Emulated delayed scaling: fold the amax values recorded since the last commit into the histories. Also
        called after evaluation, whose forwards record amax as TE's do, so that a checkpoint saved right after an
        evaluation holds what the run continues with."""
        if self.emulator is not None:
            self.emulator.commit()

    def weights_changed(self) -> None:
        """The weights were updated or loaded: FP8 copies cached from them are stale."""
        self.weight_cache.weights_changed()

    # --- recipe switches during the run ---------------------------------------------------------------
    @contextlib.contextmanager
    def forced_bf16(self):
        """Every micro-batch inside runs with FP8 off (the BF16 reference of a validation). FP8 state is not
        touched: no autocast region is entered, so no amax is recorded and no scale updated."""
        self.bf16_reference = True
        try:
            yield
        finally:
            self.bf16_reference = False

    def switch_recipe(self, step: int, recipe: str, reason: str, calibrate: bool = True) -> None:
        """From ``step`` on, the FP8 phase running there uses ``recipe`` (or ``bf16``); delayed scaling is
        calibrated first, on ``calibration_steps`` BF16 steps, as at the flip (unless it was: ``calibrate``)."""
        self.switches.append({"step": step, "recipe": recipe, "reason": reason, "calibrate": calibrate})
        self._apply_switches()
        self.weights_changed()

    def _apply_switches(self) -> None:
        phases = list(self.configured)
        for sw in self.switches:
            base = _in_force(sorted(phases, key=lambda p: p.start_step), sw["step"])
            if sw["recipe"] == "bf16":
                phases.append(replace(base, precision="bf16", start_step=sw["step"]))
                continue
            start = sw["step"]
            if sw["recipe"] == "delayed" and base.calibration_steps and sw.get("calibrate", True):
                phases.append(replace(base, precision="bf16", start_step=start))
                start += base.calibration_steps
            phases.append(replace(base, precision="fp8", recipe=sw["recipe"], start_step=start))
        self.phases = sorted(phases, key=lambda p: p.start_step)  # stable: a switch wins over its phase

    def next_fallback(self, step: int) -> str:
        """The recipe the configured fallback chain of the phase at ``step`` goes to next (``bf16`` at its end).
        A recipe chosen by ``recipe: auto`` steps to the chain's first other entry."""
        now = self.phase_at(step).recipe
        configured = _in_force(self.configured, step)
        chain = [configured.recipe, *configured.fallback]
        if now in chain:
            rest = chain[chain.index(now) + 1:]
        else:
            rest = [r for r in configured.fallback if r != now]
        return rest[0] if rest else "bf16"

    def in_fp8(self) -> bool:
        """Whether the current micro-batches run in FP8 (the current step's phase, outside ``forced_bf16``)."""
        return self.phase_at(self.step).precision == "fp8" and not self.bf16_reference

    def choice_pending(self, step: int) -> bool:
        """``recipe: auto`` starts at ``step`` and its recipe is still to be chosen."""
        return self.phase_at(step).recipe == AUTO and self.phase_at(step).precision == "fp8"

    def candidates(self, step: int) -> tuple:
        return self.phase_at(step).candidates

    @contextlib.contextmanager
    def trying(self, step: int, recipe: str):
        """The micro-batches inside run the phase at ``step`` with ``recipe`` (probing a candidate)."""
        saved = self.phases
        ph = self.phase_at(step)
        self.phases = sorted(self.phases + [replace(ph, recipe=recipe, start_step=step)], key=lambda p: p.start_step)
        try:
            yield
        finally:
            self.phases = saved

    # --- state ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"fallback_from_step": self.fallback_from_step, "rollbacks": self.rollbacks,
                "switches": list(self.switches)}

    def load_state_dict(self, state: dict) -> None:
        self.fallback_from_step = state.get("fallback_from_step")
        self.rollbacks = state.get("rollbacks", 0)
        self.switches = list(state.get("switches", []))
        self._apply_switches()


def _in_force(phases: list[Phase], step: int) -> Phase:
    """The phase of ``phases`` (sorted by start step; of equal starts the later one) in force at ``step``."""
    current = phases[0]
    for ph in phases:
        if ph.start_step <= step:
            current = ph
    return current


class _KeptInBF16:
    """Forward hooks that run one TE decoder layer with FP8 disabled inside an FP8 region."""

    def __init__(self, layer):
        self.open: list = []
        layer.register_forward_pre_hook(self.enter)
        layer.register_forward_hook(self.exit)

    def enter(self, module, args):
        import transformer_engine.pytorch as te

        ctx = te.autocast(enabled=False)
        ctx.__enter__()
        self.open.append(ctx)

    def exit(self, module, args, output):
        self.open.pop().__exit__(None, None, None)
        return output


def fp8_summary(model) -> dict:
    """amax / scale summaries of the FP8 state (TE modules' ``fp8_meta`` or the emulation's histories)."""
    amaxes, scales = [], []
    for module in model.modules():
        meta = getattr(module, "fp8_meta", None)
        state = meta.get("scaling_fwd") if meta else None
        # only delayed scaling keeps an amax history; current and block scaling hold no state between steps
        if state is not None and hasattr(state, "amax_history"):
            # TE rolls the history after each update (row 0 restarts at zero): read the whole window; slots
            # that never saw a value (amax 0) keep scale 1 and say nothing about the scaling
            seen = state.amax_history.amax(dim=0)
            if bool((seen > 0).any()):
                amaxes.append(seen.max().item())
                scales.append(state.scale[seen > 0].min().item())
        emu = getattr(module, "_fp8_emu_state", None)
        if emu is not None and emu.numel():
            amaxes.append(emu[..., 0].max().item())
    out = {}
    if amaxes:
        out["fp8/amax_max"] = max(amaxes)
    if scales:
        out["fp8/scale_min"] = min(scales)
    return out
