"""The parity check's report (benchmarks/parity/__main__.py) on the H200's raw curves in docs/perf-raw: the calls of
runs AE, AF and AH give docs/performance.md's figures, each run from A's checkpoint compared only within its own call.

LLM-jp-4's recipe (``--recipe``): its Megatron-LM command lines, read as Megatron-LM core_v0.19 reads them, and ours,
read by llmjp_ds's own functions, give every step the same batch, LR and run length, W-A1's checkpoint imports and
branches into D1's decay and blend; its two calls, on stood-in runs, give the report's rows."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks.parity import __main__ as harness
from llmjp_ds.metrics.curves import _ITERATION

RAW = Path(__file__).resolve().parents[1] / "docs" / "perf-raw"


def rows(out: Path) -> dict[str, list[str]]:
    lines = (out / "summary-parity.md").read_text().splitlines()
    return {cells[1].strip(): [c.strip() for c in cells[2:-1]]
            for line in lines if line.startswith("| ") and len(cells := line.split("|")) == 9}


@pytest.mark.parametrize("order", [("continued", "spreads"), ("spreads", "continued")])
def test_run_ae_gives_the_documented_gaps(order, tmp_path):
    calls = [RAW / "run-ae" / name for name in order] + [RAW / "run-ad"]
    assert harness.main(["--report-from", *map(str, calls), "--out", str(tmp_path)]) == 0
    got = rows(tmp_path)
    fp8, round_trip = "FP8 from the flip (both from A's checkpoint)", "round trip: A imported at the flip, BF16"
    assert got[fp8] == ["0.0039", "0.0056", "0.69", "+0.033 %", "-0.094 %", "yes"]
    assert got[round_trip] == ["0.0030", "0.0053", "0.57", "+0.060 %", "+0.069 %", "yes"]
    assert got["BF16, 1..end (against B, uninterrupted like ours)"][:3] == ["0.1068", "0.1096", "0.97"]
    assert all((tmp_path / png).read_bytes()[:4] == b"\x89PNG" for png in
               ("parity-bf16.png", "parity-fp8.png", "parity-roundtrip.png"))


@pytest.mark.parametrize("order", [("call-1", "call-2"), ("call-2", "call-1")])
def test_run_af_gives_the_documented_gap_from_step_1(order, tmp_path):
    """B and ours ran in one call, A (the spread) in another: runs from the initial weights pair across calls."""
    calls = [RAW / "run-af" / name for name in order]
    assert harness.main(["--report-from", *map(str, calls), "--out", str(tmp_path)]) == 0
    got = rows(tmp_path)
    assert got["BF16, 1..end (against B, uninterrupted like ours)"] == ["0.0296", "0.0629", "0.47", "+0.032 %",
                                                                         "+1.267 %", "yes"]
    assert got["FP8 from the flip (both from A's checkpoint)"][0] == "not run"


def test_run_ah_gives_the_documented_recipe_rows(tmp_path):
    """LLM-jp-4's recipe: the stable run and its spread in call 1, the decay branch and its spread in call 2."""
    calls = [RAW / "run-ah" / name for name in ("call-1", "call-2")]
    assert harness.main(["--report-from", *map(str, calls), "--out", str(tmp_path)]) == 0
    got = rows(tmp_path)
    assert got["recipe: stable WSD, batch 1 to 4, 1..end (against W-B)"] == ["0.0417", "0.0648", "0.64", "+0.444 %",
                                                                             "+2.214 %", "NO"]
    assert got["recipe: decay branch of W-A's checkpoint, another blend (against D1)"] == [
        "0.0004", "0.0009", "0.46", "-0.010 %", "+0.032 %", "yes"]
    assert all((tmp_path / png).read_bytes()[:4] == b"\x89PNG" for png in ("parity-wsd.png", "parity-decay.png"))


def test_a_comparison_whose_spread_no_call_has_is_not_run(tmp_path):
    """The continuing call alone has ours and Megatron's continuation but no spread; the spreads' call alone has no
    ours: neither is reported, though together they are."""
    for call in ("continued", "spreads"):
        assert harness.main(["--report-from", str(RAW / "run-ae" / call), "--out", str(tmp_path / call)]) == 0
        got = rows(tmp_path / call)
        assert got["FP8 from the flip (both from A's checkpoint)"][0] == "not run"
        assert got["round trip: A imported at the flip, BF16"][0] == "not run"


def test_the_harness_schedules_its_runs_and_fails_on_a_failed_one(tmp_path, monkeypatch):
    """The training path, each run stood in for by a process that prints what it printed in run AE's second call
    (Megatron's lines; our metrics.jsonl into its run directory), each after its predecessors: its
    parity-curves.tgz, reported on beside the first call's, gives the documented figures; and a run that fails
    makes the check fail, with the runs after it skipped."""
    import sys
    import tarfile

    call = RAW / "run-ae" / "continued"

    def shows(name, steps):
        lines = [line for line in (call / f"{name}.log").read_text().splitlines()
                 if (m := _ITERATION.search(line)) and int(m.group(1)) in steps]
        return [sys.executable, "-c", "import sys; print('\\n'.join(sys.argv[1:]))", *lines]

    def fake_jobs(setup, work, runs, mlm, blend, tokenizer, fail=()):
        def copies(name):
            return [sys.executable, "-c", "import os, shutil, sys; os.makedirs(sys.argv[2]); "
                    "shutil.copy(sys.argv[1], sys.argv[2] + '/metrics.jsonl')", str(call / name / "metrics.jsonl"),
                    str(runs / name)]

        plan = [("A1", shows("megatron-a", range(1, 251)), ()),
                ("A2", shows("megatron-a", range(251, 501)), ("A1",)),
                ("import", [sys.executable, "-c", "pass"], ("A1",)),
                ("F1", shows("megatron-f1", range(251, 501)), ("A1",)),
                ("ours-fp8", copies("ours-fp8"), ("import",)), ("ours-bf16", copies("ours-bf16"), ("import",))]
        return [harness.Job(name, [sys.executable, "-c", "raise SystemExit(3)"] if name in fail else cmd, after,
                            gib=50, estimate_s=1) for name, cmd, after in plan]

    monkeypatch.setattr(harness, "prepare", lambda work, tokenizer, megabytes: [])
    (tmp_path / "work" / "init-megatron").mkdir(parents=True)
    (tmp_path / "work" / "logs").mkdir()  # an earlier call's log in the same --work: not a run of this call
    (tmp_path / "work" / "logs" / "B.log").write_text((RAW / "run-af" / "call-1" / "megatron-b.log").read_text())
    (tmp_path / "work" / "init-megatron" / "latest_checkpointed_iteration.txt").write_text("release")
    args = ["--megatron-lm", str(tmp_path), "--tokenizer", "t.model", "--work", str(tmp_path / "work"),
            "--no-fixtures", "--budget-s", "120"]
    monkeypatch.setattr(harness, "jobs", fake_jobs)
    assert harness.main([*args, "--out", str(tmp_path / "out")]) == 0
    with tarfile.open(tmp_path / "out" / "parity-curves.tgz") as tar:
        assert "megatron-b.log" not in tar.getnames()
        tar.extractall(tmp_path / "unpacked", filter="data")
    assert harness.main(["--report-from", str(tmp_path / "unpacked"), str(RAW / "run-ae" / "spreads"), "--out",
                 str(tmp_path / "report")]) == 0
    assert harness.main(["--report-from", str(call), str(RAW / "run-ae" / "spreads"), "--out",
                 str(tmp_path / "documented")]) == 0
    assert rows(tmp_path / "report") == rows(tmp_path / "documented")
    assert rows(tmp_path / "report")["round trip: A imported at the flip, BF16"][2] == "0.57"

    monkeypatch.setattr(harness, "jobs", lambda *a: fake_jobs(*a, fail=("A1",)))
    assert harness.main([*args, "--out", str(tmp_path / "failed")]) == 1
    summary = (tmp_path / "failed" / "summary-parity.md").read_text()
    assert "- A1: failed" in summary and "- ours-fp8: skipped" in summary


# --- LLM-jp-4's recipe (--recipe): its command lines as each stack reads them -----------------------------------

MLM = Path("/megatron-lm")
CORPORA = [(0.5, "/w/corpus/python-1_text_document"), (0.3, "/w/corpus/python-2_text_document"),
           (0.2, "/w/corpus/python-3_text_document")]


def recipe_commands() -> dict[str, list[str]]:
    """Each recipe run's command, as the harness starts it."""
    from benchmarks.parity.spec import Recipe, Setup

    made = harness.recipe_jobs(Setup(), Recipe(), Path("/w"), Path("/w/runs"), MLM, CORPORA, "/w/t.model")
    return {job.name: job.cmd for job in made}


def pretrain_args(cmd: list[str]) -> list[str]:
    return cmd[cmd.index(str(MLM / "pretrain_gpt.py")) + 1:]


def sets_of(cmd: list[str]) -> list[str]:
    return [cmd[i + 1] for i, x in enumerate(cmd) if x == "--set"]


def megatron_reads(argv: list[str]):
    """``argv`` as Megatron-LM core_v0.19 reads the arguments these checks rest on, on one GPU (data parallel 1):
    its parser's flags (training/arguments.py; the config dataclasses' fields become ``--`` and the name with ``-``
    for ``_``, booleans ``store_true``: training/argument_utils.py; defaults from TrainingConfig, SchedulerConfig,
    ValidationConfig, OptimizerConfig and TransformerConfig), then validate_args's batch, run-length and
    weight-decay steps."""
    import argparse

    p = argparse.ArgumentParser(allow_abbrev=False)
    for flag in ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--num-query-groups",
                 "--kv-channels", "--seq-length", "--micro-batch-size", "--global-batch-size", "--train-iters",
                 "--train-samples", "--lr-decay-iters", "--lr-decay-samples", "--lr-wsd-decay-iters",
                 "--lr-wsd-decay-samples", "--exit-interval", "--save-interval", "--eval-interval",
                 "--eval-global-batch-size"):
        p.add_argument(flag, type=int)
    for flag, default in (("--eval-iters", 100), ("--lr-warmup-iters", 0), ("--lr-warmup-samples", 0),
                          ("--rotary-base", 10000)):
        p.add_argument(flag, type=int, default=default)
    for flag, default in (("--lr", None), ("--min-lr", 0.0), ("--lr-warmup-init", 0.0), ("--lr-warmup-fraction", None),
                          ("--weight-decay", 0.01), ("--start-weight-decay", None), ("--end-weight-decay", None),
                          ("--adam-beta1", 0.9), ("--adam-beta2", 0.999), ("--adam-eps", 1e-8), ("--clip-grad", 1.0)):
        p.add_argument(flag, type=float, default=default)
    p.add_argument("--norm-epsilon", dest="layernorm_epsilon", type=float, default=1e-5)
    p.add_argument("--rampup-batch-size", type=int, nargs=3)
    p.add_argument("--step-batch-size-schedule")
    p.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
                   default="linear")
    p.add_argument("--lr-wsd-decay-style", choices=["exponential", "linear", "cosine", "minus_sqrt"],
                   default="exponential")
    p.add_argument("--weight-decay-incr-style", choices=["constant", "linear", "cosine"], default="constant")
    p.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                   dest="override_opt_param_scheduler", action="store_true")
    p.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   dest="use_checkpoint_opt_param_scheduler", action="store_true")
    for flag in ("--group-query-attention", "--finetune"):
        p.add_argument(flag, action="store_true")
    p.add_argument("--data-path", nargs="*")
    for flag in ("--load", "--save"):
        p.add_argument(flag)
    a, _ = p.parse_known_args(argv)
    if a.step_batch_size_schedule is not None and a.global_batch_size is not None:
        raise ValueError("Cannot specify both --step-batch-size-schedule and --global-batch-size")
    if a.global_batch_size is None:
        a.global_batch_size = a.micro_batch_size * 1
    if a.eval_global_batch_size is None:
        a.eval_global_batch_size = a.global_batch_size
    if a.train_iters:
        assert a.train_samples is None and a.lr_decay_samples is None and a.lr_warmup_samples == 0
    if a.train_samples:
        assert a.train_iters is None and a.lr_decay_iters is None and a.lr_warmup_iters == 0
    if a.weight_decay_incr_style == "constant":
        assert a.start_weight_decay is None and a.end_weight_decay is None
        a.start_weight_decay = a.end_weight_decay = a.weight_decay
    return a


def megatron_batches(a) -> list[int]:
    """The global batch of each iteration, as many as Megatron-LM trains: StepBatchsizeNumMicroBatchesCalculator
    (core/num_microbatches_calculator.py: thresholds with their K/M/B/T suffixes, divided by --seq-length into
    samples, sorted; an iteration's batch is that of the last threshold its consumed samples reach) stepped as
    update_train_iters steps it (training.py: iterations while the consumed samples are below --train-samples)."""
    def number(text):
        text = text.strip().upper()
        for suffix, multiplier in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
            if text.endswith(suffix):
                return int(float(text[:-1]) * multiplier)
        return int(float(text))

    entries = a.step_batch_size_schedule.strip().replace(",", " ").split()
    schedule = sorted(((number(t) // a.seq_length, number(b)) for t, b in (e.split(":", 1) for e in entries)),
                      key=lambda x: x[0])
    assert schedule[0][0] == 0 and all(x[0] < y[0] for x, y in zip(schedule, schedule[1:]))
    batches, consumed = [], 0
    while consumed < a.train_samples:
        batch = schedule[0][1]
        for threshold, size in schedule:
            if consumed < threshold:
                break
            batch = size
        batches.append(batch)
        consumed += batch
    return batches


def megatron_scheduler(a):
    """megatron-core's OptimizerParamScheduler as get_optimizer_param_scheduler builds it for sample-based
    training (training.py), and the param groups it sets the LR of."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class Optimizer:
        param_groups = [{"wd_mult": 1.0}]

    assert a.train_samples and not a.train_iters
    decay = a.train_samples if a.lr_decay_samples is None else a.lr_decay_samples
    warmup = a.lr_warmup_samples if a.lr_warmup_fraction is None else a.lr_warmup_fraction * decay
    sched = OptimizerParamScheduler(
        Optimizer(), init_lr=a.lr_warmup_init, max_lr=a.lr, min_lr=a.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=decay, lr_decay_style=a.lr_decay_style, start_wd=a.start_weight_decay,
        end_wd=a.end_weight_decay, wd_incr_steps=a.train_samples, wd_incr_style=a.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=a.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=a.override_opt_param_scheduler, wsd_decay_steps=a.lr_wsd_decay_samples,
        lr_wsd_decay_style=a.lr_wsd_decay_style)
    return sched, Optimizer.param_groups[0]


def megatron_lrs(sched, group, batches) -> list[float]:
    """The LR of each iteration: what the param groups hold when it steps; the scheduler steps by the batch after
    each (training.py, train_step)."""
    out = []
    for batch in batches:
        out.append(group["lr"])
        sched.step(increment=batch)
    return out


def ours_lrs(cfg, first: int, saved: dict | None = None) -> list[float]:
    """Our LR of steps ``first`` .. the end: the config's schedule (reconciled with a checkpoint's ``saved``
    schedule under ``optim.resume_schedule``, as a resume does)."""
    from llmjp_ds.data.batch_schedule import BatchSchedule
    from llmjp_ds.optim.lr_schedule import resumed, run_schedule

    sched = run_schedule(cfg)
    if saved is not None:
        sched = resumed(sched, saved, cfg.optim.resume_schedule)
    batches = BatchSchedule.of(cfg.train)
    return [sched.lr(step, batches.consumed_at(step)) for step in range(first, cfg.train.steps)]


def recipe_disagreements(commands: dict[str, list[str]], monkeypatch) -> list[str]:
    """What the recipe's Megatron runs and ours read differently; each entry names it. W-A1 is checkpointed as
    Megatron-LM checkpoints it (its arguments after validate_args, the consumed samples, the scheduler's state),
    imported by llmjp_ds's own checks and settings (import-megatron's), and branched by ``llmjp-ds branch``'s
    config (branch_config over the imported run's, its past checked as create_branch checks it)."""
    import types

    from llmjp_ds.data.batch_schedule import BatchSchedule
    from llmjp_ds.interchange import megatron as megatron_import
    from llmjp_ds.checkpoint.branch import branch_config
    from llmjp_ds.interchange.megatron_reader import MegatronCheckpoint
    from llmjp_ds.checkpoint.resume_checks import check_same_past
    from llmjp_ds.config import RunConfig, apply_set, build_config, load_config, megatron_sample_counts, model_config_of
    from llmjp_ds.errors import UserError

    out = []
    wa1, wa2, wb, d1, d2 = (megatron_reads(pretrain_args(commands[n])) for n in ("W-A1", "W-A2", "W-B", "D1", "D2"))
    wsd_cmd = commands["ours-wsd"]
    cfg = load_config(None, sets_of(wsd_cmd), wsd_cmd[wsd_cmd.index("--preset") + 1])
    batches, ours_batches = megatron_batches(wb), BatchSchedule.of(cfg.train)
    if megatron_batches(wa1) != batches or megatron_batches(d1) != batches:
        out.append("Megatron's runs' batches")
    if [ours_batches.batch(s, ours_batches.consumed_at(s)) for s in range(cfg.train.steps)] != batches:
        out.append("the batch of each step")
    if cfg.train.steps != len(batches):
        out.append("train.steps against update_train_iters")
    if ours_batches.consumed_at(cfg.train.steps) != wb.train_samples:
        out.append("the samples consumed at the last step against --train-samples")
    valid = (len(batches) // wb.eval_interval + 1) * wb.eval_iters * wb.eval_global_batch_size
    if megatron_sample_counts(cfg) != (wb.train_samples, valid, wb.eval_iters * wb.eval_global_batch_size):
        out.append("the datasets' sizes (get_train_valid_test_num_samples)")
    if cfg.data.blend != [x for w, p in zip(wb.data_path[::2], wb.data_path[1::2]) for x in (float(w), p)]:
        out.append("the stable run's blend")
    stable = megatron_lrs(*megatron_scheduler(wb), batches)
    if ours_lrs(cfg, 0) != pytest.approx(stable, rel=1e-12, abs=1e-18):
        out.append("the stable run's LR")

    branch_step = wa1.exit_interval
    sched, group = megatron_scheduler(wa1)
    megatron_lrs(sched, group, batches[:branch_step])
    saved = sched.state_dict()
    resumed_a2 = megatron_scheduler(wa2)  # its load_state_dict asserts every stored value is its own
    resumed_a2[0].load_state_dict(saved)
    if megatron_lrs(*resumed_a2, batches[branch_step:]) != stable[branch_step:]:
        out.append("W-A2's LR against W-B's")

    import_cmd = commands["import-w"]
    imported_cfg = load_config(None, sets_of(import_cmd), import_cmd[import_cmd.index("--preset") + 1])
    model_config = model_config_of(imported_cfg)
    args = {**vars(wa1), "consumed_train_samples": sum(batches[:branch_step]),
            "padded_vocab_size": model_config.vocab_size, "tensor_model_parallel_size": 1}
    ckpt = MegatronCheckpoint(Path(f"/w/megatron-wa/iter_{branch_step:07d}"), "torch_dist", args, branch_step, saved,
                              {}, None, branch_step)
    monkeypatch.setattr(megatron_import, "_check_tokenizer", lambda ckpt, cfg: None)  # no tokenizer file here
    try:
        megatron_import.check_config(ckpt, imported_cfg, model_config)
        data = imported_cfg.to_dict()  # as import_megatron writes config.yaml
        data["optim"].update(megatron_import.optim_settings(ckpt, imported_cfg.train.steps,
                                                            BatchSchedule.of(imported_cfg.train)))
        imported = build_config(data)
        ours_lrs(imported, branch_step, saved)  # a resume of the imported run checks its schedule against W-A1's
    except UserError as exc:
        return out + [f"the import of W-A1's checkpoint: {exc}"]

    branch_cmd = commands["branch"]
    overrides = {}
    for assignment in sets_of(branch_cmd):
        overrides = apply_set(overrides, assignment)
    branched = build_config(branch_config(data, branch_step, overrides))
    marker = types.SimpleNamespace(run_config=data, step=branch_step,
                                   consumed_samples=ckpt.arg("consumed_train_samples"))
    try:
        check_same_past(marker, branched, "W-A1's checkpoint", "branch elsewhere")
    except UserError as exc:
        out.append(f"the branch's past: {exc}")
    phases = [(p.start_step, p.blend, p.count) for p in branched.data.phases]
    other = [x for w, p in zip(d1.data_path[::2], d1.data_path[1::2]) for x in (float(w), p)]
    if phases != [(branch_step + 1, other, "run")] or d2.data_path != d1.data_path:  # the step after the branch's
        out.append("the branch's blend against D1's --data-path")
    sched, group = megatron_scheduler(d1)
    sched.load_state_dict(saved)  # --override-opt_param-scheduler: its own values, the stored count
    try:
        decay = ours_lrs(branched, branch_step, saved)
    except UserError as exc:
        return out + [f"the decay's LR: {exc}"]
    if decay != pytest.approx(megatron_lrs(sched, group, batches[branch_step:]), rel=1e-12, abs=1e-18):
        out.append("the decay's LR")
    return out


def test_the_recipe_runs_say_the_same_to_both_stacks(monkeypatch):
    from benchmarks.parity.spec import Recipe, Setup

    commands = recipe_commands()
    assert recipe_disagreements(commands, monkeypatch) == []
    # the recipe as documented: a batch of 1, 2 and 4 sequences, WSD at the peak to the end, a decay to 0 from the
    # branch step; Megatron's flags beyond those of the runs that ran on the H200 are its core_v0.19's
    recipe, setup = Recipe(), Setup()
    wb, d1 = megatron_reads(pretrain_args(commands["W-B"])), megatron_reads(pretrain_args(commands["D1"]))
    assert sorted(set(megatron_batches(wb))) == [1, 2, 4] and len(megatron_batches(wb)) == recipe.steps
    stable = megatron_lrs(*megatron_scheduler(wb), megatron_batches(wb))
    assert stable[-1] == setup.lr and stable[recipe.branch] == setup.lr
    assert d1.override_opt_param_scheduler and d1.min_lr == 0 and d1.lr_wsd_decay_style == "minus_sqrt"
    # the distributed optimizer loads a checkpoint's parameter groups by their max and min LR
    assert all((megatron_reads(pretrain_args(commands[n])).lr, megatron_reads(pretrain_args(commands[n])).min_lr)
               == (d1.lr, d1.min_lr) for n in ("W-A1", "W-A2", "W-B", "D2"))
    ran = next(j for j in harness.jobs(setup, Path("/w"), Path("/w/runs"), MLM, CORPORA, "t") if j.name == "A1")
    new_flags = {x for n in ("W-A1", "W-B", "D1") for x in pretrain_args(commands[n]) if x.startswith("--")} - \
        {x for x in ran.cmd if x.startswith("--")}
    assert new_flags == {"--step-batch-size-schedule", "--train-samples", "--lr-warmup-samples", "--lr-decay-samples",
                         "--lr-wsd-decay-style", "--lr-wsd-decay-samples", "--override-opt_param-scheduler"}
    assert "--global-batch-size" not in pretrain_args(commands["W-B"])


@pytest.mark.parametrize("command, change, names", [
    ("ours-wsd", "optim.decay_steps=139", "the stable run's LR"),  # the decay one step early
    ("ours-wsd", "train.batch_changes=[{start_step: 1, global_batch_size: 1}, {start_step: 17, global_batch_size: 2},"
                 " {start_step: 32, global_batch_size: 4}]", "the batch of each step"),
    ("ours-wsd", "train.steps=139", "train.steps against update_train_iters"),
    ("import-w", "train.batch_changes=[{start_step: 1, global_batch_size: 1}, {start_step: 16, global_batch_size: 2}]",
     "the import of W-A1's checkpoint"),
    ("branch", "optim.wsd_decay_steps=99", "the decay's LR"),
    ("branch", "data.blend=[0.2, /w/corpus/python-1_text_document, 0.8, /w/corpus/python-3_text_document]",
     "the branch's blend against D1's --data-path"),
])
def test_a_recipe_run_that_says_otherwise_is_caught(command, change, names, monkeypatch):
    commands = recipe_commands()
    commands[command] = [*commands[command], "--set", change]
    assert any(d.startswith(names) for d in recipe_disagreements(commands, monkeypatch))


def test_megatron_refuses_a_global_batch_beside_the_step_schedule():
    args = pretrain_args(recipe_commands()["W-B"])
    with pytest.raises(ValueError, match="Cannot specify both"):
        megatron_reads([*args, "--global-batch-size", "4"])


# --- the recipe's runs through the harness, each stood in for by what it prints ---------------------------------
# No H200 has run the recipe yet: the stand-ins print curves made here, on a grid of 1/32 in [2, 10), which
# Megatron's %E lines carry exactly, and the mean of two too (a process's second line, megatron_unmixed's)

W_CALL, D_CALL = "W-A1,W-B,ours-wsd,W-A2", "W-A1,D1,import-w,branch,ours-decay,D2"


def stood_in_curves(off: int = 0) -> dict[str, dict[int, float]]:
    """Each recipe run's losses: the spreads (W-A against W-B, D2 against D1) off by 1/32 on every odd step, ours
    on every fourth step from the branch step's next (and by ``off``/32 more on every decay step)."""
    from benchmarks.parity.spec import Recipe

    recipe = Recipe()
    stable = {s: round((2 + 7 * math.exp(-s / 25)) * 32) for s in range(1, recipe.steps + 1)}
    decay = {s: round((2 + 3 * math.exp(-(s - recipe.branch) / 30)) * 32) for s in range(recipe.branch + 1,
                                                                                        recipe.steps + 1)}
    odd = {s: s % 2 for s in stable}
    fourth = {s: int(s % 4 == 1) for s in stable}
    return {name: {s: (units[s] + shift.get(s, 0) + (off if name == "ours-decay" else 0)) / 32 for s in units}
            for name, units, shift in (("W-B", stable, {}), ("W-A", stable, odd), ("ours-wsd", stable, fourth),
                                       ("D1", decay, {}), ("D2", decay, odd), ("ours-decay", decay, fourth))}


def stood_in_recipe(real, curves, fail=()):
    """``recipe_jobs`` with each run's command replaced by a process that prints its Megatron lines or writes our
    metrics.jsonl (the names, order and predecessors are the harness's own)."""
    import dataclasses
    import json
    import sys

    def prints(losses, first):
        lines = [f" [t] iteration {s:8d}/ {max(losses):8d} | consumed samples: {s} | learning rate: 3.000000E-04 | "
                 f"lm loss: {(loss + losses[s - 1]) / 2 if s == first + 1 else loss:E} | loss scale: 1.0 | "
                 "grad norm: 1.000 | number of skipped iterations:   0 |" for s, loss in losses.items()]
        return [sys.executable, "-c", "import sys; print('\\n'.join(sys.argv[1:]))", *lines]

    def writes(run_dir, losses):
        text = "".join(json.dumps({"step": s, "loss": loss, "grad_norm": 1.0, "lr": 3e-4}) + "\n"
                       for s, loss in losses.items())
        return [sys.executable, "-c", "import os, sys; os.makedirs(sys.argv[1], exist_ok=True); "
                "open(sys.argv[1] + '/metrics.jsonl', 'w').write(sys.argv[2])", str(run_dir), text]

    def fake(setup, recipe, work, runs, mlm, blend, tokenizer):
        k = recipe.branch
        a = curves["W-A"]
        cmds = {"W-A1": prints({s: x for s, x in a.items() if s <= k}, 1),
                "W-A2": prints({s: x for s, x in a.items() if s > k}, k + 1), "W-B": prints(curves["W-B"], 1),
                "ours-wsd": writes(runs / "ours-wsd", curves["ours-wsd"]), "D1": prints(curves["D1"], k + 1),
                "D2": prints(curves["D2"], k + 1), "import-w": [sys.executable, "-c", "pass"],
                "branch": [sys.executable, "-c", "import os, sys; os.makedirs(sys.argv[1])", str(runs / "ours-decay")],
                "ours-decay": writes(runs / "ours-decay", curves["ours-decay"])}
        made = real(setup, recipe, work, runs, mlm, CORPORA, tokenizer)
        assert {job.name for job in made} == set(cmds)
        return [dataclasses.replace(job, cmd=[sys.executable, "-c", "raise SystemExit(3)"] if job.name in fail
                                    else cmds[job.name], estimate_s=1) for job in made]

    return fake


@pytest.fixture
def recipe_harness(tmp_path, monkeypatch):
    """``main`` of a call on stood-in runs: its arguments, then its summary's rows."""
    real = harness.recipe_jobs
    monkeypatch.setattr(harness, "prepare", lambda work, tokenizer, megabytes: [])
    (tmp_path / "work" / "init-megatron").mkdir(parents=True)
    (tmp_path / "work" / "init-megatron" / "latest_checkpointed_iteration.txt").write_text("release")

    def call(out, *args, curves=None, fail=()):
        monkeypatch.setattr(harness, "recipe_jobs", stood_in_recipe(real, curves or stood_in_curves(), fail))
        return harness.main(["--megatron-lm", str(tmp_path), "--tokenizer", "t.model", "--work", str(tmp_path / "work"),
                             "--budget-s", "120", "--out", str(tmp_path / out), *args])

    return call


WSD_ROW = "recipe: stable WSD, batch 1 to 4, 1..end (against W-B)"
DECAY_ROW = "recipe: decay branch of W-A's checkpoint, another blend (against D1)"
# ours 1/32 off on 25 of the last 100 steps, each spread on 50 of them; both equal at the last step
MEETS = ["0.0078", "0.0156", "0.50", "+0.000 %", "+0.000 %", "yes"]


def test_the_recipes_two_calls_give_its_rows(recipe_harness, tmp_path):
    """The documented calls, each on its own (a call's checkpoint does not outlive it), then reported on together in
    either order. Megatron's second line after W-A2's, D1's and D2's start (at the branch step) is taken apart: the
    spreads would read 0.0158 otherwise."""
    import tarfile

    assert recipe_harness("w", "--recipe", "--only", W_CALL) == 0
    assert recipe_harness("d", "--recipe", "--only", D_CALL) == 0
    for call in ("w", "d"):
        with tarfile.open(tmp_path / call / "parity-curves.tgz") as tar:
            tar.extractall(tmp_path / f"unpacked-{call}", filter="data")
    assert rows(tmp_path / "w")[WSD_ROW] == MEETS and rows(tmp_path / "w")[DECAY_ROW][0] == "not run"
    assert rows(tmp_path / "d")[DECAY_ROW] == MEETS and rows(tmp_path / "d")[WSD_ROW][0] == "not run"
    for order in (("w", "d"), ("d", "w")):
        out = tmp_path / f"report-{''.join(order)}"
        unpacked = [str(tmp_path / f"unpacked-{c}") for c in order]
        assert harness.main(["--report-from", *unpacked, "--out", str(out)]) == 0
        got = rows(out)
        assert got[WSD_ROW] == MEETS and got[DECAY_ROW] == MEETS
        assert got["FP8 from the flip (both from A's checkpoint)"][0] == "not run"
        assert all((out / png).read_bytes()[:4] == b"\x89PNG" for png in ("parity-wsd.png", "parity-decay.png"))
        summary = (out / "summary-parity.md").read_text()
        assert "| run | loss / grad norm at step 1 | 2 | 41 | 42 |" in summary and "Recipe: Recipe(" in summary


def test_a_recipe_run_that_fails_or_strays_fails_the_check(recipe_harness, tmp_path):
    assert recipe_harness("failed", "--recipe", "--only", D_CALL, fail=("import-w",)) == 1
    summary = (tmp_path / "failed" / "summary-parity.md").read_text()
    assert "- import-w: failed" in summary and "- branch: skipped" in summary and "- ours-decay: skipped" in summary
    assert rows(tmp_path / "failed")[DECAY_ROW][0] == "not run"
    # ours 3/32 off on every decay step: 6.5 times the spread, 4.5 % off at the last step
    assert recipe_harness("strays", "--recipe", "--only", D_CALL, curves=stood_in_curves(off=3)) == 0
    assert rows(tmp_path / "strays")[DECAY_ROW][2:] == ["6.50", "+4.478 %", "+0.000 %", "NO"]


@pytest.mark.parametrize("args, says", [
    (["--recipe", "--only", "W-A2,D1"], "--only names W-A2, which starts after W-A1: name W-A1 too"),
    (["--only", "W-B,ours-wsd"], "(the recipe's runs need --recipe, the MoE check's --moe)"),
    (["--recipe", "--only", "B,ours"], "--only names B, ours, not among the runs of --recipe"),
])
def test_only_refuses_runs_it_cannot_run(args, says, recipe_harness, capsys):
    with pytest.raises(SystemExit) as stopped:
        recipe_harness("refused", *args)
    assert stopped.value.code == 2 and says in capsys.readouterr().err
