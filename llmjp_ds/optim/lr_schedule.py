"""The learning-rate and weight-decay schedule as values and pure functions, as Megatron-Core's.

:class:`LRSchedule` holds megatron-core's ``OptimizerParamScheduler`` as values (its counts in samples) and gives
the LR and weight decay of an iteration; :func:`lr_schedule` builds it from the run config as Megatron-LM's
``get_optimizer_param_scheduler`` builds its scheduler, and :func:`resumed` reconciles it with a checkpoint's
schedule as the scheduler's ``load_state_dict`` does. No torch here: config validation checks a schedule
(:func:`check_schedule`) before the heavy imports.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from llmjp_ds.data.batch_schedule import BatchSchedule
from llmjp_ds.config import RESUME_SCHEDULES
from llmjp_ds.errors import fail


@dataclass(frozen=True)
class LRSchedule:
    """megatron-core's ``OptimizerParamScheduler`` as values. ``warmup``, ``decay``, ``wsd_decay`` and ``wd_incr``
    count samples, as Megatron's ``lr_warmup_steps``, ``lr_decay_steps``, ``wsd_decay_steps`` and
    ``wd_incr_steps`` do; ``convention`` says what drives the schedule: ``megatron`` the samples consumed before
    an iteration (Megatron steps its scheduler by the global batch after each iteration), ``llmjp`` the step, with
    the counts in steps of ``global_batch_size`` samples."""

    init_lr: float
    max_lr: float
    min_lr: float
    warmup: int
    decay: int
    decay_style: str
    wsd_decay: int | None
    wsd_decay_style: str
    start_wd: float
    end_wd: float
    wd_incr: int
    wd_incr_style: str
    convention: str = "megatron"
    global_batch_size: int = 1

    def lr(self, step: int, consumed_samples: int) -> float:
        """The LR of step ``step`` (from 0), which starts after ``consumed_samples`` samples."""
        if self.convention == "llmjp":
            return self._llmjp_lr(step)
        return self._megatron_lr(consumed_samples)

    def weight_decay(self, step: int, consumed_samples: int) -> float:
        """The weight decay of the decayed parameters at step ``step`` (megatron-core's ``get_wd``)."""
        if self.convention == "llmjp":
            position, incr = step, self.wd_incr / self.global_batch_size
        else:
            position, incr = consumed_samples, self.wd_incr
        if position > incr or self.wd_incr_style == "constant":
            return self.end_wd
        ratio = position / incr
        if self.wd_incr_style == "linear":
            coeff = ratio
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def _megatron_lr(self, samples: int) -> float:
        """megatron-core's ``get_lr`` at ``num_steps = samples``."""
        if self.warmup > 0 and samples <= self.warmup:
            return self.init_lr + (self.max_lr - self.init_lr) * float(samples) / float(self.warmup)
        if self.decay_style == "constant":
            return self.max_lr
        if samples > self.decay:
            return self.min_lr
        if self.decay_style == "inverse-square-root":
            return max(self.min_lr, self.max_lr * max(self.warmup, 1) ** 0.5 / max(samples, 1) ** 0.5)
        if self.decay_style == "WSD":
            coeff = wsd_coefficient(samples, self.decay, self.wsd_decay, self.wsd_decay_style)
        else:
            coeff = decay_coefficient(self.decay_style, float(samples - self.warmup) / float(self.decay - self.warmup))
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def _llmjp_lr(self, step: int) -> float:
        """The same shapes in steps, with llmjp-ds's warmup: its first step already at ``max_lr / warmup``."""
        gbs = self.global_batch_size
        warmup, decay = self.warmup / gbs, self.decay / gbs
        if warmup and step < warmup:
            return self.init_lr + (self.max_lr - self.init_lr) * (step + 1) / warmup
        if self.decay_style == "constant":
            return self.max_lr
        if step >= decay:
            return self.min_lr
        if self.decay_style == "inverse-square-root":
            return max(self.min_lr, self.max_lr * max(warmup, 1) ** 0.5 / max(step, 1) ** 0.5)
        progress = (step - warmup) / max(1, decay - warmup)
        if self.decay_style == "cosine":  # rounded as recorded trails hold it (tests/test_lr_schedule.py)
            return self.min_lr + 0.5 * (self.max_lr - self.min_lr) * (1.0 + math.cos(math.pi * progress))
        if self.decay_style == "WSD":
            coeff = wsd_coefficient(step, decay, self.wsd_decay / gbs, self.wsd_decay_style)
        else:
            coeff = decay_coefficient(self.decay_style, progress)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def state_dict(self, consumed_samples: int) -> dict:
        """megatron-core's ``OptimizerParamScheduler.state_dict()`` after ``consumed_samples`` samples."""
        return {"max_lr": self.max_lr, "lr_warmup_steps": self.warmup, "num_steps": consumed_samples,
                "lr_decay_style": self.decay_style, "lr_decay_steps": self.decay, "min_lr": self.min_lr,
                "start_wd": self.start_wd, "end_wd": self.end_wd, "wd_incr_style": self.wd_incr_style,
                "wd_incr_steps": self.wd_incr}


def decay_coefficient(style: str, ratio: float) -> float:
    """The share of ``max_lr - min_lr`` left at ``ratio`` (0 to 1) of a linear, cosine, exponential or minus_sqrt
    decay (megatron-core's formulas)."""
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if style == "exponential":
        return (2.0 * math.pow(0.5, ratio)) - 1.0
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(ratio)
    raise ValueError(f"unknown decay style {style!r}")


def wsd_coefficient(position: float, decay_end: float, wsd_decay: float, wsd_decay_style: str) -> float:
    """WSD after the warmup: stable (1) until its decay of ``wsd_decay`` that ends at ``decay_end``."""
    anneal_start = decay_end - wsd_decay
    if position <= anneal_start:
        return 1.0
    return decay_coefficient(wsd_decay_style, float(position - anneal_start) / float(wsd_decay))


def lr_schedule(optim_cfg, train_steps: int, batches: BatchSchedule) -> LRSchedule:
    """The config's schedule. Under ``megatron`` its step counts are samples: a count of ``k`` steps is the
    samples the run's batch schedule ``batches`` reads in its first ``k`` steps, so the warmup ends, the WSD decay
    begins and the decay ends at the steps the config names, whatever the batch does on the way. With a constant
    batch that is Megatron-LM's ``get_optimizer_param_scheduler`` for ``--lr-*-iters`` (``k x
    --global-batch-size``); with a ramp or batch changes it is Megatron-LM's sample-based arguments
    (``--train-samples``, ``--lr-warmup-samples``, ``--lr-decay-samples``, ``--lr-wsd-decay-samples``) for the same
    plan, which a restart with another ``--global-batch-size`` keeps as they are. ``llmjp`` counts steps."""
    o = optim_cfg
    gbs = batches.global_batch
    samples = batches.consumed_at if o.schedule == "megatron" else (lambda steps: steps * gbs)
    decay_steps = train_steps if o.decay_steps is None else o.decay_steps
    decay = samples(decay_steps)  # the WSD decay: from the samples before its first step to the decay's end
    return LRSchedule(
        init_lr=o.warmup_init_lr, max_lr=float(o.lr), min_lr=o.end_lr, warmup=samples(o.warmup_steps),
        decay=decay, decay_style=o.decay_style,
        wsd_decay=None if o.wsd_decay_steps is None else decay - samples(decay_steps - o.wsd_decay_steps),
        wsd_decay_style=o.wsd_decay_style,
        start_wd=o.weight_decay, end_wd=o.weight_decay if o.end_weight_decay is None else o.end_weight_decay,
        wd_incr=samples(train_steps), wd_incr_style=o.weight_decay_incr_style, convention=o.schedule,
        global_batch_size=gbs)


def run_schedule(cfg) -> LRSchedule:
    """The LR schedule of run config ``cfg``, its counts in the samples of its batch schedule."""
    return lr_schedule(cfg.optim, cfg.train.steps, BatchSchedule.of(cfg.train))


def check_schedule(optim_cfg, train_steps: int) -> None:
    """What megatron-core's scheduler asserts, and what makes a schedule end before it starts, in one line each."""
    o = optim_cfg
    decay_steps = train_steps if o.decay_steps is None else o.decay_steps
    decay_key = "optim.decay_steps" if o.decay_steps is not None else "train.steps"
    unset = "" if o.decay_steps is not None else " (optim.decay_steps is unset)"
    if o.min_lr is not None and o.min_lr > o.lr:
        fail(f"optim.min_lr={o.min_lr} is above optim.lr={o.lr}: the decay ends at it from the peak (Megatron's "
             "--min-lr); lower it")
    if o.warmup_init_lr > o.lr:
        fail(f"optim.warmup_init_lr={o.warmup_init_lr} is above optim.lr={o.lr}: the warmup rises from it to the "
             "peak (Megatron's --lr-warmup-init); lower it")
    if o.decay_style == "WSD" and o.wsd_decay_steps is None:
        fail("optim.decay_style=WSD needs the length of its decay: set optim.wsd_decay_steps (Megatron's "
             "--lr-wsd-decay-iters), e.g. a tenth of the decay steps")
    # a run shorter than its warmup under the llmjp convention's defaults only warms up (a smoke run); Megatron
    # asserts lr_warmup_steps < lr_decay_steps
    if decay_steps <= o.warmup_steps and (o.schedule == "megatron" or o.decay_steps is not None or
                                          o.decay_style == "WSD"):
        fail(f"the LR decay ends at {decay_key}={decay_steps}{unset}, before the warmup of optim.warmup_steps="
             f"{o.warmup_steps} does: set {decay_key} above {o.warmup_steps}, or shorten the warmup")
    if o.decay_style == "WSD" and o.wsd_decay_steps > decay_steps - o.warmup_steps:
        fail(f"optim.wsd_decay_steps={o.wsd_decay_steps} is longer than the {decay_steps - o.warmup_steps} steps "
             f"from the warmup's end to the decay's ({decay_key} - optim.warmup_steps{unset}): shorten it, or set a "
             "later optim.decay_steps")
    end_wd = o.weight_decay if o.end_weight_decay is None else o.end_weight_decay
    if end_wd < o.weight_decay:
        fail(f"optim.end_weight_decay={end_wd} is below optim.weight_decay={o.weight_decay}, where it starts: the "
             "weight decay only rises (Megatron's --end-weight-decay >= --start-weight-decay); raise it, or unset it "
             "for a constant weight decay")
    if o.weight_decay_incr_style == "constant" and end_wd != o.weight_decay:
        fail(f"optim.end_weight_decay={end_wd} differs from optim.weight_decay={o.weight_decay}, but "
             "optim.weight_decay_incr_style is constant: set it to linear or cosine, or unset end_weight_decay")


# What megatron-core's load_state_dict reads, in its order: (the key it stores now, the keys it reads, newest last;
# our field; where our value comes from). WSD's length and style, and the warmup's first LR, it never stores.
_SAVED_LR_VALUES = (
    ("max_lr", ("start_lr", "max_lr"), "max_lr", "optim.lr"),
    ("min_lr", ("min_lr",), "min_lr", "optim.min_lr, or optim.lr x optim.min_lr_ratio"),
    ("lr_warmup_steps", ("warmup_iter", "warmup_steps", "lr_warmup_steps"), "warmup",
     "samples: the batches of the first optim.warmup_steps steps"),
    ("lr_decay_steps", ("end_iter", "decay_steps", "lr_decay_steps"), "decay",
     "samples: the batches of the first optim.decay_steps steps (default train.steps)"),
    ("lr_decay_style", ("decay_style", "lr_decay_style"), "decay_style", "optim.decay_style"),
)
_SAVED_WD_VALUES = (  # stored together since Megatron-LM added weight-decay increments
    ("start_wd", ("start_wd",), "start_wd", "optim.weight_decay"),
    ("end_wd", ("end_wd",), "end_wd", "optim.end_weight_decay"),
    ("wd_incr_steps", ("wd_incr_steps",), "wd_incr", "samples: the batches of the run's train.steps steps"),
    ("wd_incr_style", ("wd_incr_style",), "wd_incr_style", "optim.weight_decay_incr_style"),
)


def resumed(configured: LRSchedule, saved: dict | None, mode: str) -> LRSchedule:
    """The schedule a resume continues with, from the config's (``configured``) and the one the checkpoint stored
    (``saved``, a :meth:`LRSchedule.state_dict` or megatron-core's; None: a checkpoint of an earlier release,
    which stored none) as megatron-core's ``load_state_dict`` reconciles them under ``mode``
    (``optim.resume_schedule``): ``check`` every stored value must equal the configured one, ``override`` the
    configured schedule, ``checkpoint`` the stored values (WSD's and the warmup's first LR from the config)."""
    if mode not in RESUME_SCHEDULES:
        raise ValueError(f"unknown resume mode {mode!r}")
    if saved is None or mode == "override":
        return configured
    values = list(_SAVED_LR_VALUES) + (list(_SAVED_WD_VALUES) if "start_wd" in saved else [])
    stored = {}
    for key, names, field_name, source in values:
        stored[field_name] = saved[next((n for n in names if n in saved), names[-1])]  # older names first
        if mode == "check" and not _agrees(field_name, stored, configured, saved):
            fail(f"the checkpoint's LR schedule has {key}={stored[field_name]}, this run's config "
                 f"{getattr(configured, field_name)} ({source}): set optim.resume_schedule=override to follow the "
                 "config from here on (Megatron's --override-opt_param-scheduler), or optim.resume_schedule="
                 "checkpoint to keep the checkpoint's (--use-checkpoint-opt_param-scheduler)")
    if mode == "check":
        return configured
    if stored["decay_style"] == "WSD" and configured.wsd_decay is None:
        fail("the checkpoint's LR schedule is WSD, whose decay length it does not store: set optim.wsd_decay_steps "
             "(and optim.wsd_decay_style) as the run that wrote it had them")
    return dataclasses.replace(configured, **stored)


def _agrees(field_name: str, stored: dict, configured: LRSchedule, saved: dict) -> bool:
    """Whether a stored value is the configured one: floats to their rounding (``min_lr`` may be ``lr *
    min_lr_ratio`` here, Megatron's ``--min-lr`` there); the weight decay's increment length whenever neither side increments
    (it moves with ``train.steps`` and changes nothing then; Megatron asserts it anyway)."""
    value, ours = stored[field_name], getattr(configured, field_name)
    if field_name == "wd_incr" and configured.wd_incr_style == "constant" and \
            saved.get("wd_incr_style", "constant") == "constant":
        return True
    if isinstance(value, float) or isinstance(ours, float):
        return math.isclose(value, ours, rel_tol=1e-12, abs_tol=1e-30)
    return value == ours


def schedule_lr(step: int, optim_cfg, total_steps: int) -> float:
    """The config's LR at ``step`` of a run of ``total_steps`` whose global batch never changes (its consumed
    samples ``step`` global batches)."""
    return lr_schedule(optim_cfg, total_steps, BatchSchedule(1)).lr(step, step)


def plan_line(cfg, schedule: LRSchedule | None = None) -> str:
    """The run's schedule as a person checks it before spending GPUs on it: where the warm-up, the stable phase and
    the decay end, the LR of the last step, each batch change and data phase, each as a step (numbered from 1, as
    the progress line shows it) and the samples consumed by its end. ``schedule``: a resumed one, which may keep a
    checkpoint's values (default: the config's)."""
    s = schedule or run_schedule(cfg)
    batches, last = BatchSchedule.of(cfg.train), cfg.train.steps
    if s.convention == "megatron":
        steps_within = batches.step_at  # the steps that start before a count of samples is consumed
    else:
        steps_within = lambda samples: -(-samples // s.global_batch_size)  # noqa: E731

    def at(samples: int) -> str:
        step = steps_within(samples)
        return f"step {step} ({batches.consumed_at(step)} samples)"

    parts = [f"warm-up to {at(s.warmup)}" if s.warmup else "no warm-up"]
    if s.decay_style == "WSD":
        parts += [f"stable to {at(s.decay - s.wsd_decay)}", f"{s.wsd_decay_style} decay to {at(s.decay)}"]
    elif s.decay_style != "constant":
        parts.append(f"{s.decay_style} decay to {at(s.decay)}")
    parts.append(f"LR {s.lr(last - 1, batches.consumed_at(last - 1)):.3g} at step {last}, the last "
                 f"({batches.consumed_at(last)} samples)")
    (_, first_batch), *pieces = batches.pieces(last)
    changes = [f"batch {first_batch} from step 1"]
    if batches.rampup:
        ramp_end = min([steps_within(batches.rampup[2] + 1)] + [c for c, _ in batches.changes if c > 0] + [last])
        changes.append(f"ramping to {batches.batch(ramp_end, batches.consumed_at(ramp_end))} by step {ramp_end + 1} "
                       f"(after {batches.consumed_at(ramp_end)} samples)")
        pieces = [p for p in pieces if p[0] > ramp_end]
    changes += [f"batch {b} from step {first + 1} (after {batches.consumed_at(first)} samples)"
                for first, b in pieces]
    changes += [f"data.phases[{i}] from step {p.start_step} (after {batches.consumed_at(p.start_step - 1)} samples)"
                for i, p in enumerate(cfg.data.phases)]
    return f"plan: {', '.join(parts)}; {', '.join(changes)}"
