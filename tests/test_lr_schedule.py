"""The LR and weight-decay schedules (llmjp_ds.optim.lr_schedule.LRSchedule): ``optim.schedule=megatron`` against
megatron-core's own OptimizerParamScheduler (the class Megatron-LM steps by the global batch after each iteration),
built from the same iteration-based arguments as Megatron-LM builds it, iteration by iteration, for every decay style,
and resumed from a checkpoint as its load_state_dict resumes; ``llmjp`` against its formula."""

from __future__ import annotations

import json
import math
import textwrap
import warnings

import pytest

from llmjp_ds.errors import UserError
from llmjp_ds.optim.lr_schedule import LRSchedule, resumed, run_schedule, schedule_lr


def megatron_lrs(iterations: int, gbs: int, lr: float, min_lr: float, warmup: int, decay: int) -> list[float]:
    """The LR megatron-core gives each of ``iterations`` iterations: what its param groups hold when the
    iteration's optimizer step runs (set at construction, then by ``step(gbs)`` after each iteration)."""
    OptimizerParamScheduler = _scheduler_class()

    class Groups:  # the optimizer as the scheduler sees it: its param groups
        param_groups = [{}]

    sched = OptimizerParamScheduler(Groups(), init_lr=0.0, max_lr=lr, min_lr=min_lr, lr_warmup_steps=warmup * gbs,
                                    lr_decay_steps=decay * gbs, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                    wd_incr_steps=decay * gbs, wd_incr_style="constant")
    out = []
    for _ in range(iterations):
        out.append(Groups.param_groups[0]["lr"])
        sched.step(increment=gbs)
    return out


def cosine(step: int, convention: str, *, lr: float, warmup_steps: int, decay_steps: int, min_lr_ratio: float):
    """The cosine schedule of ``convention`` at ``step``, counting one sample a step."""
    return LRSchedule(init_lr=0.0, max_lr=lr, min_lr=lr * min_lr_ratio, warmup=warmup_steps, decay=decay_steps,
                      decay_style="cosine", wsd_decay=None, wsd_decay_style="exponential", start_wd=0.0, end_wd=0.0,
                      wd_incr=decay_steps, wd_incr_style="constant", convention=convention).lr(step, step)


@pytest.mark.parametrize("warmup, decay", [(5, 20), (0, 12), (1, 3)])
def test_megatron_schedule_is_megatron_cores(warmup, decay):
    # cosine, with warmup, and past the end of the decay; a global batch of 3 samples (Megatron counts samples)
    theirs = megatron_lrs(decay + 6, 3, 3e-4, 3e-5, warmup, decay)
    ours = [cosine(s, "megatron", lr=3e-4, warmup_steps=warmup, decay_steps=decay, min_lr_ratio=0.1)
            for s in range(decay + 6)]
    assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-18)
    if warmup:
        assert theirs[0] == 0.0 and theirs[warmup] == pytest.approx(3e-4)  # Megatron's first step learns nothing


def test_llmjp_schedule_first_step_learns():
    assert cosine(0, "llmjp", lr=1.0, warmup_steps=4, decay_steps=10, min_lr_ratio=0.1) == 0.25
    assert cosine(3, "llmjp", lr=1.0, warmup_steps=4, decay_steps=10, min_lr_ratio=0.1) == 1.0
    assert cosine(7, "llmjp", lr=1.0, warmup_steps=4, decay_steps=10, min_lr_ratio=0.1) == pytest.approx(
        0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))


def test_schedule_lr_follows_the_config():
    from llmjp_ds.config import load_config

    llmjp = load_config(None, ["optim.warmup_steps=4", "optim.lr=1.0"])
    megatron = load_config(None, ["optim.warmup_steps=4", "optim.lr=1.0", "optim.schedule=megatron"])
    assert schedule_lr(0, llmjp.optim, 100) == 0.25 and schedule_lr(0, megatron.optim, 100) == 0.0
    assert load_config(None, [], "llmjp3-172b").optim.schedule == "megatron"
    assert load_config(None, [], "demo").optim.schedule == "llmjp"


# --- every style against megatron-core, step by step: LR and weight decay --------------------------------------

def _scheduler_class():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    return OptimizerParamScheduler


class MegatronOptimizer:
    """The optimizer as megatron-core's scheduler sees it: its param groups, one decayed and one not (norms)."""

    def __init__(self):
        self.param_groups = [{"wd_mult": 1.0}, {"wd_mult": 0.0}]


def megatron_lm_scheduler(args: dict, **flags):
    """megatron-core's scheduler as Megatron-LM's get_optimizer_param_scheduler builds it from iteration-based
    arguments (``train_iters``, ``global_batch_size``, ``lr_*_iters``, ...; unset ones at Megatron-LM's defaults;
    ``--min-lr`` as ``lr * min_lr_ratio``, as our config gives it) and ``flags`` (override / use-checkpoint)."""
    a = {"lr_decay_iters": None, "lr_wsd_decay_iters": None, "lr_warmup_init": 0.0, "lr_decay_style": "cosine",
         "lr_wsd_decay_style": "exponential", "weight_decay_incr_style": "constant", **args}
    gbs = a["global_batch_size"]
    decay_iters = a["train_iters"] if a["lr_decay_iters"] is None else a["lr_decay_iters"]
    wsd = None if a["lr_wsd_decay_iters"] is None else a["lr_wsd_decay_iters"] * gbs
    opt = MegatronOptimizer()
    return opt, _scheduler_class()(
        opt, init_lr=a["lr_warmup_init"], max_lr=a["lr"], min_lr=a["lr"] * a["min_lr_ratio"],
        lr_warmup_steps=a["lr_warmup_iters"] * gbs,
        lr_decay_steps=decay_iters * gbs, lr_decay_style=a["lr_decay_style"], start_wd=a["start_weight_decay"],
        end_wd=a["end_weight_decay"], wd_incr_steps=a["train_iters"] * gbs, wd_incr_style=a["weight_decay_incr_style"],
        wsd_decay_steps=wsd, lr_wsd_decay_style=a["lr_wsd_decay_style"], **flags)


def megatron_trail(opt, sched, iterations: int, gbs: int) -> tuple[list[float], list[float]]:
    """The LR and weight decay (of the decayed group) each iteration's update runs with; the scheduler is stepped by
    the global batch after each, as Megatron-LM's train_step does."""
    lrs, wds = [], []
    for _ in range(iterations):
        lrs.append(opt.param_groups[0]["lr"])
        wds.append(opt.param_groups[0]["weight_decay"])
        assert opt.param_groups[1]["weight_decay"] == 0.0
        sched.step(increment=gbs)
    return lrs, wds


def our_trail(schedule: LRSchedule, iterations: int, gbs: int, step: int = 0,
              consumed: int = 0) -> tuple[list[float], list[float]]:
    steps = [(step + i, consumed + i * gbs) for i in range(iterations)]
    return [schedule.lr(s, c) for s, c in steps], [schedule.weight_decay(s, c) for s, c in steps]


def config_of(args: dict):
    """Our config with the Megatron-LM arguments ``args``."""
    from llmjp_ds.config import load_config

    end_wd = args["end_weight_decay"]
    values = {"optim.schedule": "megatron", "optim.lr": args["lr"], "optim.min_lr_ratio": args["min_lr_ratio"],
              "optim.warmup_steps": args["lr_warmup_iters"], "optim.decay_steps": args.get("lr_decay_iters"),
              "optim.decay_style": args.get("lr_decay_style", "cosine"),
              "optim.wsd_decay_steps": args.get("lr_wsd_decay_iters"),
              "optim.wsd_decay_style": args.get("lr_wsd_decay_style", "exponential"),
              "optim.warmup_init_lr": args.get("lr_warmup_init", 0.0),
              "optim.weight_decay": args["start_weight_decay"],
              "optim.end_weight_decay": None if end_wd == args["start_weight_decay"] else end_wd,
              "optim.weight_decay_incr_style": args.get("weight_decay_incr_style", "constant"),
              "train.steps": args["train_iters"], "train.global_batch_size": args["global_batch_size"]}
    return load_config(None, [f"{k}={'null' if v is None else v}" for k, v in values.items()])


def our_schedule(args: dict) -> LRSchedule:
    from llmjp_ds.optim.lr_schedule import check_schedule

    cfg = config_of(args)
    check_schedule(cfg.optim, cfg.train.steps)
    return run_schedule(cfg)


def same(ours: list[float], theirs: list[float]) -> bool:
    return ours == pytest.approx(theirs, rel=1e-12, abs=1e-18)


# scaled down: 20 warm-up iterations, 1000 iterations, a global batch of 4 samples
SMALL = {"train_iters": 1000, "global_batch_size": 4, "lr": 3e-4, "min_lr_ratio": 0.1, "lr_warmup_iters": 20,
         "start_weight_decay": 0.1, "end_weight_decay": 0.1}
WSD_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


def check_against_megatron(args: dict, iterations: int | None = None) -> tuple[list[float], list[float]]:
    gbs, n = args["global_batch_size"], iterations or args["train_iters"] + 10  # and past the decay's end
    theirs = megatron_trail(*megatron_lm_scheduler(args), n, gbs)
    ours = our_trail(our_schedule(args), n, gbs)
    assert same(ours[0], theirs[0]) and same(ours[1], theirs[1])
    return theirs


@pytest.mark.parametrize("style, wsd_style", [(s, None) for s in ("constant", "linear", "cosine",
                                                                      "inverse-square-root")] +
                         [("WSD", w) for w in WSD_STYLES])
def test_every_decay_style_is_megatron_cores(style, wsd_style):
    args = {**SMALL, "lr_decay_style": style}
    if wsd_style:
        args.update(lr_wsd_decay_iters=300, lr_wsd_decay_style=wsd_style)
    lrs, _ = check_against_megatron(args)
    assert lrs[0] == 0.0 and lrs[20] == 3e-4  # Megatron's first step at 0, the peak after the warmup
    if style == "WSD":
        assert lrs[700] == pytest.approx(3e-4, rel=1e-15) and lrs[701] < lrs[700]  # stable, then decays
        assert lrs[1000] == pytest.approx(3e-5)


def test_a_decay_shorter_than_the_run_and_an_init_lr_are_megatron_cores():
    check_against_megatron({**SMALL, "lr_decay_style": "linear", "lr_decay_iters": 600, "lr_warmup_init": 1e-5})
    check_against_megatron({**SMALL, "lr_decay_style": "WSD", "lr_decay_iters": 800, "lr_wsd_decay_iters": 100,
                            "lr_wsd_decay_style": "minus_sqrt", "lr_warmup_init": 3e-5, "min_lr_ratio": 0.0})
    check_against_megatron({**SMALL, "lr_warmup_iters": 0})  # no warmup: the first step at the peak


@pytest.mark.parametrize("incr_style", ["linear", "cosine"])
def test_weight_decay_increments_are_megatron_cores(incr_style):
    _, wds = check_against_megatron({**SMALL, "start_weight_decay": 0.01, "end_weight_decay": 0.1,
                                     "weight_decay_incr_style": incr_style})
    assert wds[0] == 0.01 and wds[1000] == pytest.approx(0.1) and wds[500] == pytest.approx(0.055)


def test_llmjp4_base_is_megatron_cores():
    """LLM-jp-4's base: 2000 warm-up iterations, WSD whose decay is its last iteration (--lr-wsd-decay-iters 1),
    decay-iters = train-iters (a run of 2500 iterations of 1024 samples here)."""
    args = {"train_iters": 2500, "global_batch_size": 1024, "lr": 4e-4, "min_lr_ratio": 0.1, "lr_warmup_iters": 2000,
            "lr_decay_style": "WSD", "lr_wsd_decay_iters": 1, "start_weight_decay": 0.1, "end_weight_decay": 0.1}
    lrs, _ = check_against_megatron(args)
    assert lrs[2000:2500] == pytest.approx([4e-4] * 500, rel=1e-15) and lrs[2500] == lrs[2509] == 4e-4 * 0.1


def test_an_absolute_min_lr_is_megatrons_min_lr():
    """optim.min_lr is Megatron-LM's --min-lr as written (lr x min_lr_ratio rounds: 3e-4 x 0.1 is
    2.9999999999999997e-05): the llmjp4 presets' 3e-5, and a linear decay to it against megatron-core's."""
    from llmjp_ds.config import load_config

    assert run_schedule(load_config(None, [], "llmjp4-8b")).min_lr == 3e-5
    assert run_schedule(load_config(None, [])).min_lr == 3e-3 * 0.1  # neither set: a tenth of the peak
    cfg = load_config(None, ["optim.schedule=megatron", "optim.lr=3e-4", "optim.min_lr=3e-5", "optim.warmup_steps=20",
                             "optim.decay_style=linear", "train.steps=1000", "train.global_batch_size=4"])
    opt = MegatronOptimizer()
    sched = _scheduler_class()(opt, init_lr=0.0, max_lr=3e-4, min_lr=3e-5, lr_warmup_steps=80, lr_decay_steps=4000,
                               lr_decay_style="linear", start_wd=0.1, end_wd=0.1, wd_incr_steps=4000,
                               wd_incr_style="constant")
    theirs = megatron_trail(opt, sched, 1010, 4)
    ours = our_trail(run_schedule(cfg), 1010, 4)
    assert same(ours[0], theirs[0]) and theirs[0][-1] == 3e-5


def test_one_step_off_fails_the_comparison():
    lrs, _ = megatron_trail(*megatron_lm_scheduler({**SMALL, "lr_decay_style": "cosine"}), 200, 4)
    off = list(lrs)
    off[150] *= 1 + 1e-10
    assert same(lrs, lrs) and not same(off, lrs)


# --- the LLM-jp-4 decay branch: a stable run's checkpoint, resumed under new arguments ----------------------

STABLE = {**SMALL, "lr_decay_style": "WSD", "lr_wsd_decay_iters": 1}  # --lr-decay-iters = --train-iters
BRANCH = {**STABLE, "lr_wsd_decay_iters": 300, "lr_wsd_decay_style": "minus_sqrt", "min_lr_ratio": 0.0}


def stable_checkpoint(iterations: int, args: dict = STABLE) -> dict:
    """megatron-core's opt_param_scheduler state after ``iterations`` iterations of ``args``; ours equals it."""
    opt, sched = megatron_lm_scheduler(args)
    megatron_trail(opt, sched, iterations, args["global_batch_size"])
    theirs = sched.state_dict()
    ours = our_schedule(args).state_dict(iterations * args["global_batch_size"])
    assert ours == theirs and list(ours) == list(theirs)
    return theirs


def resumed_trails(saved: dict, args: dict, mode: str, iterations: int, done: int, consumed: int):
    """(ours, megatron-core's) LR and weight-decay trails from a resume of ``saved`` under ``args`` at iteration
    ``done`` after ``consumed`` samples."""
    flags = {"override": {"override_opt_param_scheduler": True, "use_checkpoint_opt_param_scheduler": False},
             "checkpoint": {"use_checkpoint_opt_param_scheduler": True},
             "check": {"use_checkpoint_opt_param_scheduler": False}}[mode]
    opt, sched = megatron_lm_scheduler(args, **flags)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched.load_state_dict(dict(saved))
    theirs = megatron_trail(opt, sched, iterations, args["global_batch_size"])
    ours = our_trail(resumed(our_schedule(args), saved, mode), iterations, args["global_batch_size"], done,
                     consumed)
    return ours, theirs


@pytest.mark.parametrize("branch_at", [500, 700, 850])
def test_the_decay_branch_overrides_the_stable_schedule(branch_at):
    """--override-opt_param-scheduler with --min-lr 0 --lr-wsd-decay-style minus_sqrt --lr-wsd-decay-iters: the
    branch's schedule from the stable run's samples on; before its decay starts (500), at it (700), inside (850)."""
    saved = stable_checkpoint(branch_at)
    ours, theirs = resumed_trails(saved, BRANCH, "override", 1010 - branch_at, branch_at, branch_at * 4)
    assert same(ours[0], theirs[0]) and same(ours[1], theirs[1])
    assert theirs[0][1000 - branch_at] == 0.0  # minus_sqrt reaches min_lr 0 at the end


def test_use_checkpoint_keeps_the_stored_schedule():
    """--use-checkpoint-opt_param-scheduler: max/min LR, warmup, decay and its style, the weight decay's values
    from the checkpoint; WSD's decay length and style, which it does not store, from the arguments."""
    saved = stable_checkpoint(600, {**STABLE, "lr_wsd_decay_iters": 200, "start_weight_decay": 0.01,
                                    "end_weight_decay": 0.1, "weight_decay_incr_style": "linear"})
    args = {**BRANCH, "lr": 1e-3, "lr_warmup_iters": 50, "lr_decay_iters": 900, "lr_wsd_decay_iters": 250}
    ours, theirs = resumed_trails(saved, args, "checkpoint", 410, 600, 2400)
    # megatron-core's load_state_dict sets the groups (step) before it takes the stored weight decay: its first
    # iteration after the load decays by the arguments' values, every later one by the stored schedule's
    assert same(ours[0], theirs[0]) and same(ours[1][1:], theirs[1][1:]) and theirs[1][0] == 0.1
    decay_from = 1000 - 250 - 600 + 1  # the stored decay's end less the configured WSD decay
    assert theirs[0][decay_from - 1] == pytest.approx(3e-4, rel=1e-15) and theirs[0][decay_from] < 2.99e-4


def test_check_accepts_the_same_schedule_and_refuses_another_as_megatron_core_asserts():
    saved = stable_checkpoint(300)
    ours, theirs = resumed_trails(saved, STABLE, "check", 710, 300, 1200)
    assert same(ours[0], theirs[0]) and same(ours[1], theirs[1])
    for args, line in [
        (BRANCH, "the checkpoint's LR schedule has min_lr=2.9999999999999997e-05, this run's config 0.0 (optim.min_lr, "
                 "or optim.lr x optim.min_lr_ratio): set optim.resume_schedule=override to follow the config from here "
                 "on (Megatron's --override-opt_param-scheduler), or optim.resume_schedule=checkpoint to keep the "
                 "checkpoint's (--use-checkpoint-opt_param-scheduler)"),
        ({**STABLE, "lr": 1e-3, "lr_warmup_iters": 10}, "has max_lr=0.0003, this run's config 0.001 (optim.lr)"),
        ({**STABLE, "lr_warmup_iters": 10}, "has lr_warmup_steps=80, this run's config 40 (samples: "),
        ({**STABLE, "train_iters": 2000}, "has lr_decay_steps=4000, this run's config 8000 (samples: "),
        ({**STABLE, "lr_decay_style": "cosine"}, "has lr_decay_style=WSD, this run's config cosine"),
    ]:
        with pytest.raises(AssertionError):
            resumed_trails(saved, args, "check", 1, 300, 1200)[1]
        with pytest.raises(UserError) as err:
            resumed(our_schedule(args), saved, "check")
        assert line in str(err.value) and "\n" not in str(err.value)


def test_check_compares_the_weight_decays_increment_only_where_one_side_increments():
    """A longer train.steps moves the weight decay's increment length (train_iters x gbs): megatron-core asserts on
    it even where the weight decay is constant, which changes nothing; here check lets that through, and refuses it
    where the weight decay increments."""
    longer = {**STABLE, "lr_decay_iters": 1000, "train_iters": 1200}
    with pytest.raises(AssertionError):
        resumed_trails(stable_checkpoint(300), longer, "check", 1, 300, 1200)
    assert resumed(our_schedule(longer), stable_checkpoint(300), "check") == our_schedule(longer)
    rising = {**STABLE, "weight_decay_incr_style": "linear", "end_weight_decay": 0.2}  # from start_weight_decay 0.1
    saved = stable_checkpoint(300, rising)
    with pytest.raises(UserError, match="has wd_incr_steps=4000, this run's config 4800"):
        resumed(our_schedule({**rising, "lr_decay_iters": 1000, "train_iters": 1200}), saved, "check")


def test_a_new_global_batch_converts_iterations_with_it():
    """Megatron-LM converts --lr-*-iters with the resumed run's global batch and keeps num_steps in samples: under
    override the new counts; checkpoint keeps the stored samples; check refuses, as megatron-core asserts."""
    saved = stable_checkpoint(300, {**SMALL, "lr_decay_style": "cosine"})
    wider = {**SMALL, "lr_decay_style": "cosine", "global_batch_size": 8}
    for mode in ("override", "checkpoint"):
        ours, theirs = resumed_trails(saved, wider, mode, 720, 300, 1200)
        assert same(ours[0], theirs[0]) and same(ours[1], theirs[1]), mode
    with pytest.raises(UserError, match="has lr_warmup_steps=80, this run's config 160"):
        resumed(our_schedule(wider), saved, "check")


def test_no_stored_schedule_resumes_with_the_configured_one():
    schedule = our_schedule(BRANCH)
    assert resumed(schedule, None, "check") is schedule and resumed(schedule, None, "checkpoint") is schedule
    legacy = {"start_lr": 3e-4, "min_lr": 3e-4 * 0.1, "warmup_iter": 80, "end_iter": 4000, "decay_style": "WSD",
              "num_iters": 400}  # megatron's older names, no weight decay
    assert resumed(our_schedule(STABLE), legacy, "check") == our_schedule(STABLE)
    with pytest.raises(UserError, match="is WSD, whose decay length it does not store: set optim.wsd_decay_steps"):
        resumed(our_schedule({**SMALL, "lr_decay_style": "linear"}), legacy, "checkpoint")


# --- a batch that ramps or changes: the plan in samples, as Megatron-LM's sample-based arguments ------------------

def sample_scheduler(args: dict, **flags):
    """megatron-core's scheduler as Megatron-LM's get_optimizer_param_scheduler builds it from sample-based
    arguments (``train_samples``, ``lr_warmup_samples``, ``lr_decay_samples`` (default ``train_samples``),
    ``lr_wsd_decay_samples``): what a restart with another ``--global-batch-size`` keeps unchanged."""
    a = {"lr_decay_samples": None, "lr_wsd_decay_samples": None, "lr_warmup_init": 0.0, "lr_decay_style": "WSD",
         "lr_wsd_decay_style": "linear", **args}
    decay = a["train_samples"] if a["lr_decay_samples"] is None else a["lr_decay_samples"]
    opt = MegatronOptimizer()
    return opt, _scheduler_class()(
        opt, init_lr=a["lr_warmup_init"], max_lr=a["lr"], min_lr=a["min_lr"], lr_warmup_steps=a["lr_warmup_samples"],
        lr_decay_steps=decay, lr_decay_style=a["lr_decay_style"], start_wd=0.1, end_wd=0.1,
        wd_incr_steps=a["train_samples"], wd_incr_style="constant", wsd_decay_steps=a["lr_wsd_decay_samples"],
        lr_wsd_decay_style=a["lr_wsd_decay_style"], **flags)


def megatron_batches(iterations: int, gbs: int, rampup=None, restarts=()) -> list[int]:
    """The global batch of each iteration: megatron-core's calculator for ``--rampup-batch-size`` (0.16's
    RampupBatchsizeNumMicroBatchesCalculator, as Megatron-LM updates it from the consumed samples before each
    iteration), then ``restarts``: ``(iterations done, new --global-batch-size)`` of a restarted run."""
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

    calc = None if rampup is None else RampupBatchsizeNumMicroBatchesCalculator(gbs, 1, 1, False, 0, *rampup)
    out, consumed = [], 0
    for i in range(iterations):
        batch = gbs
        if calc is not None:
            calc.update(consumed, consistency_check=False)
            batch = calc.get_current_global_batch_size()
        batch = next((b for done, b in reversed(restarts) if i >= done), batch)
        out.append(batch)
        consumed += batch
    return out


def our_plan(sets: list[str]) -> tuple[LRSchedule, "BatchSchedule"]:
    from llmjp_ds.data.batch_schedule import BatchSchedule
    from llmjp_ds.config import load_config

    cfg = load_config(None, ["optim.schedule=megatron", "optim.lr=3e-4", "optim.min_lr_ratio=0.1", *sets])
    return run_schedule(cfg), BatchSchedule.of(cfg.train)


def plan_trail(schedule: LRSchedule, batches, first: int, last: int) -> list[float]:
    """Our LR of step indices ``first .. last - 1``, as the trainer asks for it."""
    return [schedule.lr(i, batches.consumed_at(i)) for i in range(first, last)]


def _stepped(opt, sched, batches: list[int]) -> list[float]:
    """The LR of each iteration, the scheduler stepped by its batch after each (Megatron-LM's train_step)."""
    out = []
    for batch in batches:
        out.append(opt.param_groups[0]["lr"])
        sched.step(increment=batch)
    return out


# LLM-jp's phase 2 scaled down: a batch of 8 (512), then 32 (2048) from step 31 (after 30 iterations)
PHASE2 = ["train.steps=100", "train.global_batch_size=8", "optim.warmup_steps=10", "optim.decay_style=WSD",
          "optim.wsd_decay_style=linear", "optim.wsd_decay_steps=1",
          "train.batch_changes=[{start_step: 31, global_batch_size: 32}]"]
PHASE2_SAMPLES = 30 * 8 + 70 * 32  # Megatron-LM's --train-samples for the same plan


def test_phase_2_in_one_config_is_megatrons_two_runs():
    """The 512 -> 2048 plan as one config, and as Megatron-LM's two runs with its sample-based arguments (the second
    restarted after 30 iterations with another --global-batch-size, its scheduler loaded from the first's
    checkpoint as it is: the arguments did not change): the same LR at every step, at the peak through the last."""
    ours, batches = our_plan(PHASE2)
    args = {"lr": 3e-4, "min_lr": 3e-5, "train_samples": PHASE2_SAMPLES, "lr_warmup_samples": 80,
            "lr_wsd_decay_samples": 32}
    megatron = megatron_batches(100, 8, restarts=[(30, 32)])
    assert [batches.batch(i, batches.consumed_at(i)) for i in range(100)] == megatron
    opt, first = sample_scheduler(args)
    theirs = _stepped(opt, first, megatron[:30])
    saved = first.state_dict()
    opt, second = sample_scheduler(args)  # the restart: --global-batch-size 2048, the samples unchanged
    second.load_state_dict(saved)
    theirs += _stepped(opt, second, megatron[30:])
    assert same(plan_trail(ours, batches, 0, 100), theirs)
    assert theirs[10:] == pytest.approx([3e-4] * 90, rel=1e-15)  # the stable run at its peak to its last step
    assert ours.lr(100, batches.consumed_at(100)) == pytest.approx(3e-5)  # its decay ends with the run


@pytest.mark.parametrize("sets, rampup, restarts", [
    (["train.batch_rampup=[2, 2, 40]"], (2, 2, 40), []),  # a ramp: the decay over the samples it reads
    (["train.batch_rampup=[2, 2, 40]", "train.batch_changes=[{start_step: 41, global_batch_size: 16}]"],
     (2, 2, 40), [(40, 16)]),  # a ramp, then a change
    (["train.batch_changes=[{start_step: 61, global_batch_size: 4}]"], None, [(60, 4)]),  # a smaller batch
], ids=["ramp", "ramp-then-change", "change-down"])
@pytest.mark.parametrize("style", ["cosine", "WSD"])
def test_ramps_and_changes_are_megatron_cores_in_samples(sets, rampup, restarts, style):
    """Every combination against megatron-core's scheduler and calculator: the warm-up ends, the WSD decay begins
    and the decay ends at the config's steps, in the samples the batches read up to them (a cosine decay to the
    run's end; WSD over its last 20 steps)."""
    wsd = ["optim.decay_style=WSD", "optim.wsd_decay_style=minus_sqrt", "optim.wsd_decay_steps=20"]
    ours, batches = our_plan(["train.steps=100", "train.global_batch_size=8", "optim.warmup_steps=10", *sets,
                              *(wsd if style == "WSD" else ["optim.decay_style=cosine"])])
    megatron = megatron_batches(100, 8, rampup, restarts)
    total = sum(megatron)
    args = {"lr": 3e-4, "min_lr": 3e-5, "train_samples": total, "lr_warmup_samples": sum(megatron[:10]),
            "lr_decay_style": style, "lr_wsd_decay_style": "minus_sqrt", "lr_wsd_decay_samples": sum(megatron[80:])}
    theirs = _stepped(*sample_scheduler(args), megatron + [8] * 3)  # and past the end
    assert [batches.batch(i, batches.consumed_at(i)) for i in range(100)] == megatron
    assert same(plan_trail(ours, batches, 0, 103), theirs)
    if style == "WSD":
        assert theirs[80] == pytest.approx(3e-4, rel=1e-15) and theirs[81] < theirs[80]  # stable to step 81
    assert theirs[100] == pytest.approx(3e-5)  # the minimum right after the last step


@pytest.mark.parametrize("new_batch", [None, 16], ids=["same-batch", "new-batch"])
def test_a_branch_after_a_change_decays_over_its_own_steps(new_batch):
    """A decay branch from step 60 of the phase-2 run (after its change to 32), 80 steps in all, minus_sqrt to LR 0
    over its last 20, against Megatron-LM restarted from the stable run's scheduler with
    --override-opt_param-scheduler and the branch's sample-based arguments; ``new_batch``: the branch also changes
    the global batch (llmjp-ds branch --set train.global_batch_size), counting its steps in it."""
    from llmjp_ds.data.batch_schedule import BatchSchedule
    from llmjp_ds.checkpoint.branch import branch_config
    from llmjp_ds.config import build_config, load_config

    stable = load_config(None, ["optim.schedule=megatron", "optim.lr=3e-4", "optim.min_lr_ratio=0.1", *PHASE2])
    stable_schedule, stable_batches = run_schedule(stable), BatchSchedule.of(stable.train)
    saved = stable_schedule.state_dict(stable_batches.consumed_at(60))
    overrides = {"train": {"steps": 80}, "optim": {"wsd_decay_style": "minus_sqrt", "wsd_decay_steps": 20,
                                                   "min_lr_ratio": 0.0}}
    if new_batch:
        overrides["train"]["global_batch_size"] = new_batch
    branched = build_config(branch_config(stable.to_dict(), 60, overrides))
    ours = resumed(run_schedule(branched), saved, branched.optim.resume_schedule)
    batches = BatchSchedule.of(branched.train)

    after = new_batch or 32
    megatron = megatron_batches(80, 8, restarts=[(30, 32), (60, after)])
    total = sum(megatron)
    opt, sched = sample_scheduler({"lr": 3e-4, "min_lr": 0.0, "train_samples": total, "lr_warmup_samples": 80,
                                   "lr_wsd_decay_style": "minus_sqrt", "lr_wsd_decay_samples": 20 * after},
                                  override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched.load_state_dict(dict(saved))
    theirs = _stepped(opt, sched, megatron[60:] + [after])
    assert same(plan_trail(ours, batches, 60, 81), theirs)
    assert theirs[0] == pytest.approx(3e-4, rel=1e-15) and theirs[-1] == 0.0  # the decay ends with the branch
    assert [batches.batch(i, batches.consumed_at(i)) for i in range(80)] == megatron
    if new_batch:
        return
    # Megatron-LM's iteration-based arguments (--train-iters 80 --lr-wsd-decay-iters 20) restarted with
    # --global-batch-size 32 count all 80 iterations in batches of 32 while the first 30 read 8: its schedule lags
    # by 30 x 24 samples, and this branch's last step would still be at the peak (docs/llmjp4-recipe.md)
    opt, sched = megatron_lm_scheduler({**STABLE, "train_iters": 80, "global_batch_size": after, "min_lr_ratio": 0.0,
                                        "lr_warmup_iters": 10, "lr_wsd_decay_iters": 20,
                                        "lr_wsd_decay_style": "minus_sqrt"},
                                       override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched.load_state_dict(dict(saved))
    assert _stepped(opt, sched, megatron[60:])[-1] == pytest.approx(3e-4, rel=1e-15)


# --- the llmjp convention: in steps, its warmup one step ahead ------------------------------------------------

def test_llmjp_cosine_is_the_recorded_formula_bit_for_bit():
    """The formula of the LR when recorded trails were written, against the llmjp convention of the config."""
    from llmjp_ds.config import load_config

    def recorded(step, lr, warmup, decay, ratio):
        min_lr = lr * ratio
        if warmup and step < warmup:
            return lr * (step + 1) / warmup
        if step >= decay:
            return min_lr
        progress = (step - warmup) / max(1, decay - warmup)
        return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))

    for warmup, decay, gbs in [(20, 200, 8), (0, 50, 3), (2000, 5000, 1024)]:
        cfg = load_config(None, [f"optim.warmup_steps={warmup}", "optim.lr=3e-3", f"train.steps={decay}",
                                 f"train.global_batch_size={gbs}"], "demo")
        schedule = run_schedule(cfg)
        for step in range(decay + 3):
            want = recorded(step, 3e-3, warmup, decay, 0.1)
            assert schedule.lr(step, step * gbs) == want
            assert schedule_lr(step, cfg.optim, decay) == want


def test_llmjp_wsd_and_weight_decay_in_steps():
    from llmjp_ds.config import load_config

    cfg = load_config(None, ["optim.warmup_steps=4", "optim.lr=1.0", "optim.min_lr_ratio=0", "train.steps=20",
                             "optim.decay_style=WSD", "optim.wsd_decay_steps=4", "optim.wsd_decay_style=minus_sqrt",
                             "optim.warmup_init_lr=0.2", "train.global_batch_size=8", "optim.weight_decay=0.0",
                             "optim.end_weight_decay=0.2", "optim.weight_decay_incr_style=linear"])
    schedule = run_schedule(cfg)
    lrs = [schedule.lr(s, s * 8) for s in range(22)]
    assert lrs[:4] == [0.2 + 0.8 * (s + 1) / 4 for s in range(4)] and lrs[3] == 1.0
    assert lrs[4:17] == [1.0] * 13
    assert lrs[17:20] == [1 - math.sqrt(r / 4) for r in (1, 2, 3)] and lrs[20:] == [0.0, 0.0]
    assert [schedule.weight_decay(s, s * 8) for s in (0, 5, 20, 21)] == [0.0, 0.05, 0.2, 0.2]


# --- parameter groups and set_lr ----------------------------------------------------------------------------

def test_set_lr_decays_as_megatron_cores_groups():
    import torch

    from llmjp_ds.optim.adamw import parameter_groups, set_lr

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = torch.optim.AdamW(parameter_groups(model, 0.1), lr=1.0)
    assert [g["wd_mult"] for g in opt.param_groups] == [1.0, 0.0]
    megatron_opt, sched = megatron_lm_scheduler({**SMALL, "start_weight_decay": 0.01, "end_weight_decay": 0.1,
                                                 "weight_decay_incr_style": "cosine"})
    sched.step(increment=1600)
    schedule = our_schedule({**SMALL, "start_weight_decay": 0.01, "end_weight_decay": 0.1,
                             "weight_decay_incr_style": "cosine"})
    set_lr(opt, schedule.lr(400, 1600), schedule.weight_decay(400, 1600))
    assert [g[k] for g in opt.param_groups for k in ("lr", "weight_decay")] == pytest.approx(
        [g[k] for g in megatron_opt.param_groups for k in ("lr", "weight_decay")], rel=1e-12)
    for group in opt.param_groups:  # a checkpoint of an earlier release puts back groups without wd_mult
        del group["wd_mult"]
    set_lr(opt, 1.0, 0.2)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.2, 0.0]


_ZERO1_SCRIPT = textwrap.dedent("""
    import json
    import torch, deepspeed
    from llmjp_ds.optim.adamw import parameter_groups, set_lr
    out = {}
    for bf16 in (True, False):
        cfg = json.load(open("ds_configs/zero1.json"))
        cfg.update(train_batch_size=1, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1,
                   bf16={"enabled": bf16})
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        opt = torch.optim.AdamW(parameter_groups(model, 0.1), lr=1.0)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        set_lr(engine.optimizer, 0.5, 0.2)
        out[str(bf16)] = [type(engine.optimizer).__name__] + [
            [g["wd_mult"], g["lr"], g["weight_decay"]] for g in engine.optimizer.param_groups]
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.timeout(400)
def test_zero1_keeps_the_groups_wd_mult():
    """DeepSpeed's ZeRO-1 wrappers (one CPU process, the project's zero1.json, bf16 and fp32) hand set_lr the
    client optimizer's groups with their wd_mult. In a subprocess: its own process group."""
    import os
    import subprocess
    import sys

    from tests.launch import REPO, free_port

    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _ZERO1_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=380)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    groups = [[1.0, 0.5, 0.2], [0.0, 0.5, 0.0]]
    assert json.loads(lines[-1][len("RESULT "):]) == {"True": ["BF16_Optimizer", *groups],
                                                       "False": ["DeepSpeedZeroOptimizer", *groups]}


# --- import-megatron: an LLM-jp-4 checkpoint continues its schedule ---------------------------------------------

@pytest.mark.parametrize("args", [
    {**STABLE, "lr_warmup_init": 1e-5},
    {**BRANCH, "start_weight_decay": 0.01, "end_weight_decay": 0.1, "weight_decay_incr_style": "cosine"},
    {**SMALL, "lr_decay_style": "inverse-square-root"},
], ids=["wsd-init-lr", "wsd-minus-sqrt-wd-cosine", "inverse-square-root"])
def test_import_megatron_continues_its_schedule(args):
    from types import SimpleNamespace

    from llmjp_ds.interchange.megatron import optim_settings
    from llmjp_ds.config import load_config

    gbs, at = args["global_batch_size"], 750
    opt, sched = megatron_lm_scheduler(args)
    megatron_trail(opt, sched, at, gbs)
    ckpt = SimpleNamespace(directory="iter_0000750", iteration=at, scheduler=sched.state_dict(),
                           args={"global_batch_size": gbs, **args}, arg=lambda k, d=None: ckpt.args.get(k, d))
    settings = optim_settings(ckpt, args["train_iters"])
    cfg = load_config(None, [f"optim.{k}={'null' if v is None else v}" for k, v in settings.items()] +
                      [f"train.steps={args['train_iters']}", f"train.global_batch_size={gbs}"])
    schedule = run_schedule(cfg)
    assert resumed(schedule, sched.state_dict(), "check") == schedule
    assert same(our_trail(schedule, 1010 - at, gbs, at, at * gbs)[0], megatron_trail(opt, sched, 1010 - at, gbs)[0])
    if args.get("weight_decay_incr_style", "constant") != "constant":  # its increment ends at --train-iters
        with pytest.raises(UserError, match=r"over 1000 iterations \(Megatron's --train-iters\), the run config "
                                            r"over train.steps=900: set train.steps=1000"):
            optim_settings(ckpt, 900)


# --- bad input: one line each ---------------------------------------------------------------------------------

@pytest.mark.parametrize("sets, line", [
    (["optim.decay_style=WSD"], "optim.decay_style=WSD needs the length of its decay: set optim.wsd_decay_steps "
                                "(Megatron's --lr-wsd-decay-iters), e.g. a tenth of the decay steps"),
    (["optim.decay_steps=2000"], "the LR decay ends at optim.decay_steps=2000, before the warmup of "
                                 "optim.warmup_steps=2000 does: set optim.decay_steps above 2000, or shorten the "
                                 "warmup"),
    (["optim.schedule=megatron", "train.steps=100"], "the LR decay ends at train.steps=100 (optim.decay_steps is "
                                                     "unset), before the warmup of optim.warmup_steps=2000 does: set "
                                                     "train.steps above 2000"),
    (["optim.decay_style=WSD", "optim.wsd_decay_steps=10", "train.steps=1500"],
     "the LR decay ends at train.steps=1500 (optim.decay_steps is unset), before the warmup"),
    (["optim.decay_style=WSD", "optim.wsd_decay_steps=900", "optim.decay_steps=2500"],
     "optim.wsd_decay_steps=900 is longer than the 500 steps from the warmup's end to the decay's (optim.decay_steps "
     "- optim.warmup_steps): shorten it, or set a later optim.decay_steps"),
    (["optim.end_weight_decay=0.01", "optim.weight_decay_incr_style=linear"],
     "optim.end_weight_decay=0.01 is below optim.weight_decay=0.1, where it starts: the weight decay only rises "
     "(Megatron's --end-weight-decay >= --start-weight-decay); raise it, or unset it for a constant weight decay"),
    (["optim.end_weight_decay=0.2"], "optim.end_weight_decay=0.2 differs from optim.weight_decay=0.1, but "
                                     "optim.weight_decay_incr_style is constant: set it to linear or cosine, or unset "
                                     "end_weight_decay"),
    (["optim.warmup_init_lr=0.1"], "optim.warmup_init_lr=0.1 is above optim.lr=0.0003: the warmup rises from it to "
                                   "the peak (Megatron's --lr-warmup-init); lower it"),
    (["optim.min_lr=0.001"], "optim.min_lr=0.001 is above optim.lr=0.0003: the decay ends at it from the peak "
                             "(Megatron's --min-lr); lower it"),
])
def test_bad_schedules_are_one_line(sets, line):
    from llmjp_ds.config import load_config
    from llmjp_ds.optim.lr_schedule import check_schedule

    cfg = load_config(None, ["train.steps=10000", "optim.warmup_steps=2000", "optim.lr=3e-4", *sets])
    with pytest.raises(UserError) as err:
        check_schedule(cfg.optim, cfg.train.steps)
    assert str(err.value).startswith(line) and "\n" not in str(err.value)


def test_good_schedules_pass():
    from llmjp_ds.config import load_config
    from llmjp_ds.optim.lr_schedule import check_schedule

    for sets in [[], ["train.steps=10"],  # a smoke run shorter than its warmup only warms up
                 ["optim.end_weight_decay=0.1", "optim.weight_decay_incr_style=cosine"],  # cosine from 0.1 to 0.1
                 ["optim.decay_style=WSD", "optim.wsd_decay_steps=8000", "train.steps=10000"]]:
        cfg = load_config(None, sets)
        check_schedule(cfg.optim, cfg.train.steps)


@pytest.mark.parametrize("key, value, line", [
    ("decay_style", "cosin", "optim.decay_style must be one of constant, linear, cosine, inverse-square-root, WSD, "
                             "got 'cosin' (did you mean 'cosine'?)"),
    ("wsd_decay_style", "minus-sqrt", "optim.wsd_decay_style must be one of exponential, linear, cosine, minus_sqrt, "
                                      "got 'minus-sqrt' (did you mean 'minus_sqrt'?)"),
    ("weight_decay_incr_style", "cosin", "optim.weight_decay_incr_style must be one of constant, linear, cosine, got "
                                         "'cosin' (did you mean 'cosine'?)"),
    ("resume_schedule", "overide", "optim.resume_schedule must be one of check, override, checkpoint, got 'overide' "
                                   "(did you mean 'override'?)"),
])
def test_named_choices_are_one_line(key, value, line):
    from llmjp_ds.config import load_config

    with pytest.raises(UserError) as err:
        load_config(None, [f"optim.{key}={value}"])
    assert str(err.value) == line


def test_min_lr_and_its_ratio_together_are_one_line():
    from llmjp_ds.config import load_config

    with pytest.raises(UserError) as err:
        load_config(None, ["optim.min_lr_ratio=0"], "llmjp4-8b")  # the preset gives optim.min_lr: 3e-5
    assert str(err.value) == ("optim.min_lr=3e-05 and optim.min_lr_ratio=0 both give the LR the decay ends at: keep "
                              "one and set the other to null (e.g. --set optim.min_lr_ratio=null beside optim.min_lr, "
                              "Megatron's --min-lr)")
    assert load_config(None, ["optim.min_lr_ratio=0", "optim.min_lr=null"], "llmjp4-8b").optim.end_lr == 0.0
