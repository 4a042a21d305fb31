"""Log-spaced checkpoints (``checkpoint.keep``): which steps the rules keep (LLM-jp's Megatron schedule as the
reference), the rules a run refuses, and a real run whose background saves leave exactly the kept tags beside
the rotated ones, each verifying against its manifest, one of them resumed."""

from __future__ import annotations

import shutil

import pytest

from llmjp_ds import checkpoint
from llmjp_ds.config import KeepRule, check_keep_rules, kept_step, load_config, save_due
from llmjp_ds.errors import UserError

from tests.runs import run_train, trail

# LLM-jp's Megatron fork: every step below 10, every 10 below 100, every 100 below 10,000, then every 1000
LLMJP_KEEP = ("checkpoint.keep=[{every: 1, below: 10}, {every: 10, below: 100}, {every: 100, below: 10000}, "
              "{every: 1000}]")


def test_llmjp_rule_keeps_the_log_spaced_steps():
    rules = load_config(None, [LLMJP_KEEP]).checkpoint.keep
    assert rules == [KeepRule(1, 10), KeepRule(10, 100), KeepRule(100, 10000), KeepRule(1000)]
    check_keep_rules(rules)
    written_out = {*range(1, 10), *range(10, 100, 10), *range(100, 10000, 100), *range(10000, 25001, 1000)}
    assert {step for step in range(1, 25001) if kept_step(step, rules)} == written_out


def test_a_save_is_due_at_the_interval_or_a_kept_step():
    cfg = load_config(None, ["checkpoint.interval=7", "checkpoint.keep=[{every: 1, below: 3}, {every: 5}]"]).checkpoint
    assert [s for s in range(1, 22) if save_due(s, cfg)] == [1, 2, 5, 7, 10, 14, 15, 20, 21]
    cfg.interval = 0
    assert [s for s in range(1, 22) if save_due(s, cfg)] == [1, 2, 5, 10, 15, 20]
    cfg.keep = []  # no rules: only the interval (here none)
    assert not any(save_due(s, cfg) for s in range(1, 22))


def test_rules_a_run_cannot_mean_are_refused_in_one_line():
    check_keep_rules([])
    for rules, fragment in [
            ([KeepRule(1), KeepRule(5)], "checkpoint.keep[1] follows checkpoint.keep[0], which has no below"),
            ([KeepRule(1, 100), KeepRule(10, 100)], "checkpoint.keep[1].below must be above checkpoint.keep[0]"),
            ([KeepRule(0, 10)], "checkpoint.keep[0].every must be positive, got 0")]:
        with pytest.raises(UserError) as info:
            check_keep_rules(rules)
        assert fragment in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(UserError, match="checkpoint.keep\\[0\\] lacks every"):
        load_config(None, ["checkpoint.keep=[{below: 10}]"])


STEPS = 14
KEPT = {1, 2, 3, 5, 10}  # below 4 every step, then every 5th
RUN_SETS = ("checkpoint.async_save=true", "checkpoint.keep=[{below: 4, every: 1}, {every: 5}]",
            "checkpoint.interval=3", "checkpoint.keep_last=1", f"optim.decay_steps={STEPS}")


@pytest.mark.slow
@pytest.mark.timeout(600)  # the session's first training also prepares the corpus (~2 min on 2 cores)
def test_a_run_keeps_its_log_spaced_saves_through_the_background_saver(train_env, tmp_path):
    from llmjp_ds.checkpoint.resume_checks import verify_tag
    from llmjp_ds.metrics.record import read_metrics

    run_dir = run_train(tmp_path / "full", 1, f"train.steps={STEPS}", *RUN_SETS)
    committed = [e["tag"] for e in read_metrics(run_dir) if e.get("event") == "checkpoint_committed"]
    assert committed == [checkpoint.tag_for(s) for s in (1, 2, 3, 5, 6, 9, 10, 12, STEPS)]  # all in the background
    tags = dict(checkpoint.complete_tags(run_dir))
    latest = checkpoint.latest_tag(run_dir)
    # the interval's saves 6, 9 and 12 rotate out under keep_last=1: the end's save (14) is the newest unkept
    assert set(tags) == KEPT | {STEPS} and latest == checkpoint.tag_for(STEPS)
    for step, tag in tags.items():
        marker = checkpoint.read_marker(run_dir, tag)
        assert marker.kept == (step in KEPT) and marker.step == step, (tag, marker.kept)
        assert verify_tag(checkpoint.checkpoint_dir(run_dir) / tag, marker) is None, tag

    # a resume from the kept step 5: a copy of the run holding that tag alone, latest pointing at it
    kept_tag = checkpoint.tag_for(5)
    copy = tmp_path / "from5" / "run"
    shutil.copytree(run_dir, copy, ignore=lambda d, names: [
        n for n in names if d.endswith("checkpoints") and n.startswith("step") and n != kept_tag])
    (checkpoint.checkpoint_dir(copy) / checkpoint.LATEST).write_text(kept_tag)
    run_train(tmp_path / "from5", 1, "train.steps=7", *RUN_SETS)
    resumes = [(e["step"], e["tag"]) for e in read_metrics(copy) if e.get("event") == "resume"]
    assert resumes == [(5, kept_tag)]
    again, first = {r["step"]: r["loss"] for r in trail(copy)}, {r["step"]: r["loss"] for r in trail(run_dir)}
    assert [again[s] for s in (6, 7)] == [first[s] for s in (6, 7)], "the resumed steps differ from the first run's"
    assert {s for s, _ in checkpoint.complete_tags(copy)} == {5, 7}  # 6 rotated out, 5 kept
