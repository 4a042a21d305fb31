"""The LR schedules of ``optim.schedule``: ``megatron`` against megatron-core's own OptimizerParamScheduler (the
class Megatron-LM steps by the global batch after each iteration), ``llmjp`` against its formula."""

from __future__ import annotations

import math
import warnings

import pytest

from llmjp_ds.optim import lr_at, megatron_lr_at, schedule_lr


def megatron_lrs(iterations: int, gbs: int, lr: float, min_lr: float, warmup: int, decay: int) -> list[float]:
    """The LR megatron-core gives each of ``iterations`` iterations: what its param groups hold when the
    iteration's optimizer step runs (set at construction, then by ``step(gbs)`` after each iteration)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

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


@pytest.mark.parametrize("warmup, decay", [(5, 20), (0, 12), (1, 3)])
def test_megatron_schedule_is_megatron_cores(warmup, decay):
    # cosine, with warmup, and past the end of the decay; a global batch of 3 samples (Megatron counts samples)
    theirs = megatron_lrs(decay + 6, 3, 3e-4, 3e-5, warmup, decay)
    ours = [megatron_lr_at(s, lr=3e-4, warmup_steps=warmup, decay_steps=decay, min_lr_ratio=0.1)
            for s in range(decay + 6)]
    assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-18)
    if warmup:
        assert theirs[0] == 0.0 and theirs[warmup] == pytest.approx(3e-4)  # Megatron's first step learns nothing


def test_llmjp_schedule_first_step_learns():
    assert lr_at(0, lr=1.0, warmup_steps=4, decay_steps=10, min_lr_ratio=0.1) == 0.25
    assert lr_at(3, lr=1.0, warmup_steps=4, decay_steps=10, min_lr_ratio=0.1) == 1.0
    assert lr_at(7, lr=1.0, warmup_steps=4, decay_steps=10, min_lr_ratio=0.1) == pytest.approx(
        0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))


def test_schedule_lr_follows_the_config():
    from llmjp_ds.config import load_config

    llmjp = load_config(None, ["optim.warmup_steps=4", "optim.lr=1.0"])
    megatron = load_config(None, ["optim.warmup_steps=4", "optim.lr=1.0", "optim.schedule=megatron"])
    assert schedule_lr(0, llmjp.optim, 100) == 0.25 and schedule_lr(0, megatron.optim, 100) == 0.0
    assert load_config(None, [], "llmjp3-172b").optim.schedule == "megatron"
    assert load_config(None, [], "demo").optim.schedule == "llmjp"
