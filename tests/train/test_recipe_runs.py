"""LLM-jp-4's recipe in training runs: a ramped global batch resumed exactly and on another layout in the middle of
the ramp, and decay branches of a WSD run, each equal to a run that had the branch's settings from its first step.

Runs are the tiny fp32 setup of ``tests/runs.py`` (global batch 8 of micro-batches of 2). The ramp is
``--rampup-batch-size 4 4 16``: batches 4, 4, 4, 4, then 8 (megatron-core's calculator: at 16 consumed samples,
``int(16 / 16)`` increments). The branch test's reference is the strongest available: one uninterrupted run whose
config gives, from step 0, the WSD schedule with the branch's decay, the batch change and the blend change at the
branch's step; the source run (stable WSD) equals it before the branch point, the branch equals it after.
"""

from __future__ import annotations

import json
import shutil

import pytest

from llmjp_ds import checkpoint
from llmjp_ds.metrics.record import read_metrics

from tests.runs import COMMON_SETS, cli, max_rel_diff, run_train, trail
from tests.train.test_equivalence import GRAD_NORM_RTOL, LOSS_RTOL

pytestmark = pytest.mark.slow

COMPARED = ("loss", "z_loss", "lr", "grad_norm", "consumed_samples", "global_batch_size")
RAMP = ("train.batch_rampup=[4, 4, 16]", "train.micro_batch_size=1", "optim.decay_steps=6")


def same_trail(got, want, steps=None) -> None:
    a, b = trail(got), trail(want)
    if steps is not None:
        a, b = [r for r in a if r["step"] in steps], [r for r in b if r["step"] in steps]
    assert [r["step"] for r in a] == [r["step"] for r in b] and a
    for key in COMPARED:
        assert [r[key] for r in a] == [r[key] for r in b], f"{key} differs"


@pytest.fixture(scope="module")
def ramp_full(train_env, tmp_path_factory):
    return run_train(tmp_path_factory.mktemp("ramp-full"), 1, *RAMP, "train.steps=6")


@pytest.mark.timeout(900)
def test_a_ramp_resumes_exactly_in_its_middle(ramp_full, tmp_path):
    run_train(tmp_path, 1, *RAMP, "train.steps=3")
    resumed = run_train(tmp_path, 1, *RAMP, "train.steps=6")
    same_trail(resumed, ramp_full)
    assert [r["global_batch_size"] for r in trail(ramp_full)] == [4, 4, 4, 4, 8, 8]
    assert [r["consumed_samples"] for r in trail(ramp_full)] == [4, 8, 12, 16, 24, 32]


@pytest.mark.timeout(900)
def test_a_ramp_resumes_on_another_layout_in_its_middle(ramp_full, tmp_path):
    """Three steps on one process, three on two (DP2: each batch of the ramp splits into micro-batch x 2)."""
    run_train(tmp_path, 1, *RAMP, "train.steps=3")
    resumed = run_train(tmp_path, 2, *RAMP, "train.steps=6", "parallel.zero_stage=1")
    got, ref = trail(resumed), trail(ramp_full)
    assert [r["consumed_samples"] for r in got] == [r["consumed_samples"] for r in ref]
    assert [r["global_batch_size"] for r in got] == [r["global_batch_size"] for r in ref]
    assert max_rel_diff([r["loss"] for r in got], [r["loss"] for r in ref]) <= LOSS_RTOL
    assert max_rel_diff([r["grad_norm"] for r in got], [r["grad_norm"] for r in ref]) <= GRAD_NORM_RTOL
    assert [(e["step"], e["now"]) for e in read_metrics(resumed) if e.get("event") == "reshape"] == [(3, "PP1 x DP2")]


def bundled_blends() -> tuple[str, str]:
    """Two blends of the bundled corpus's preprocessed parts (the train_env cache): Japanese and English, then
    code and English; and the bundled tokenizer that reads them."""
    from llmjp_ds.data.plan import prepare_bundled

    parts, tokenizer = prepare_bundled()
    by_name = {p.rsplit("/", 1)[-1].split("_")[0]: p for _, p in parts}
    first = f"[1.0, {by_name['ja']}, 1.0, {by_name['en']}]"
    then = f"[3.0, {by_name['code']}, 1.0, {by_name['en']}]"
    return first, then, str(tokenizer)


# the source: WSD with the decay left out (LLM-jp-4's stable run), warm-up 2, Megatron's schedule in samples
STABLE = ("optim.schedule=megatron", "optim.decay_style=WSD", "optim.wsd_decay_steps=1", "optim.decay_steps=12",
          "optim.warmup_steps=2", "checkpoint.interval=3", "checkpoint.keep_last=5")
# the decay branch from step 3: 6 steps, minus_sqrt over the last 3 (in samples of the unit batch 8), to LR 0
DECAY = ("train.steps=6", "optim.decay_steps=6", "optim.wsd_decay_style=minus_sqrt", "optim.wsd_decay_steps=3",
         "optim.min_lr_ratio=0")


@pytest.mark.timeout(1200)
def test_decay_branches_start_from_a_stable_run_and_leave_it_as_it_is(train_env, tmp_path):
    first, then, tokenizer = bundled_blends()
    data = (f"data.blend={first}", f"data.tokenizer={tokenizer}")
    source = run_train(tmp_path / "source", 1, *data, *STABLE, "train.steps=4")
    tag = checkpoint.tag_for(3)
    manifest = json.loads((checkpoint.checkpoint_dir(source) / tag / checkpoint.MARKER).read_text())["files"]

    branch = tmp_path / "branch-a" / "run"
    cli(["branch", "--from", str(source), "--tag", tag, "--run", str(branch), *[x for s in DECAY for x in ("--set", s)],
         "--set", f"data.blend={then}", "--set", "train.global_batch_size=4"], tmp_path / "branch-a-cli")
    config = branch / "config.yaml"
    origin = json.loads((branch / "branch.json").read_text())
    assert (origin["tag"], origin["step"], origin["consumed_samples"]) == (tag, 3, 24)
    for steps in (5, 6):  # stopped once and resumed: a branch resumes like any run
        cli(["train", "--config", str(config), "--set", f"train.steps={steps}"], tmp_path / f"branch-a-{steps}")

    # the reference: the branch's settings from its first step (the decay, and the blend and batch changes from
    # step 4, the branch's first)
    reference = run_train(tmp_path / "reference", 1, *data, *STABLE, *DECAY,
                          f"data.phases=[{{start_step: 4, blend: {then}}}]",
                          "train.batch_changes=[{start_step: 4, global_batch_size: 4}]")
    same_trail(branch, reference, steps={4, 5, 6})
    same_trail(source, reference, steps={1, 2, 3})
    assert [r["lr"] for r in trail(reference)][-1] < [r["lr"] for r in trail(source)][-1]  # the decay ran
    events = [e for e in read_metrics(branch) if e.get("event") == "branch"]
    assert [(e["step"], e["from_tag"], e["from_step"]) for e in events] == [(3, tag, 3)]

    # a second branch from the same checkpoint, and the source going on: the source's checkpoint is untouched
    other = tmp_path / "branch-b" / "run"
    cli(["branch", "--from", str(source), "--tag", tag, "--run", str(other), "--set", "train.steps=5",
         "--set", "optim.decay_steps=5", "--set", "optim.wsd_decay_style=cosine", "--set", "optim.wsd_decay_steps=2"],
        tmp_path / "branch-b-cli")
    cli(["train", "--config", str(other / "config.yaml")], tmp_path / "branch-b-train")
    run_train(tmp_path / "source", 1, *data, *STABLE, "train.steps=6")
    from llmjp_ds.checkpoint.manifest import verify

    assert verify(checkpoint.checkpoint_dir(source) / tag, manifest, sorted(manifest)) is None
    assert [r["step"] for r in trail(other)][0] == 4

    # refused in one line, writing nothing: a blend change at a step the branch already trained, a branch onto an
    # existing run, a branch from a damaged checkpoint
    before = sorted(p.name for p in checkpoint.checkpoint_dir(branch).iterdir())
    out = cli(["train", "--config", str(config), "--set", "train.steps=7",
               "--set", f"data.phases=[{{start_step: 3, blend: {then}}}]"], tmp_path / "refused-1", check=False)
    assert out.returncode != 0 and "changes the blend of step 3, which" in out.stderr
    assert sorted(p.name for p in checkpoint.checkpoint_dir(branch).iterdir()) == before
    out = cli(["branch", "--from", str(source), "--tag", tag, "--run", str(other)], tmp_path / "refused-2", check=False)
    assert out.returncode != 0 and f"{other} already exists" in out.stderr
    damaged = tmp_path / "damaged"
    shutil.copytree(source, damaged)
    state = next((checkpoint.checkpoint_dir(damaged) / tag).glob("*model_states.pt"))
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte flipped, the size kept: only the checksum tells
    state.write_bytes(bytes(data))
    out = cli(["branch", "--from", str(damaged), "--tag", tag, "--run", str(tmp_path / "c")], tmp_path / "refused-3",
              check=False)
    assert out.returncode != 0 and "fails its manifest" in out.stderr and not (tmp_path / "c").exists()
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.timeout(900)
def test_phase_2_in_one_run_holds_its_peak_and_numbers_steps_as_its_records(train_env, tmp_path):
    """LLM-jp-4's stable run on the tiny shape with everything changing inside it: a ramp 2 -> 8, the batch 16 from
    step 26, another blend from step 20, FP8 (emulated) from step 30, steps 12-13 skipped. The LR stays at the
    peak from the warm-up's end through the last step and the schedule's decay ends exactly where the run does;
    each step the config names is the first whose record shows the change, and the plan line says so first."""
    from llmjp_ds.optim.lr_schedule import run_schedule
    from llmjp_ds.config import build_config

    first, then, tokenizer = bundled_blends()
    sets = ["model.shape=tiny", "train.steps=40", "train.global_batch_size=8", "train.batch_rampup=[2, 2, 24]",
            "train.batch_changes=[{start_step: 26, global_batch_size: 16}]", "optim.warmup_steps=5",
            f"data.blend={first}", f"data.tokenizer={tokenizer}", f"data.phases=[{{start_step: 20, blend: {then}}}]",
            "precision.phases=[{precision: bf16}, {precision: fp8, start_step: 30, recipe: current}]",
            "precision.emulate_fp8=true", "train.skip_steps=[[12, 13]]", "checkpoint.keep=[]", "checkpoint.interval=20",
            "optim.decay_steps=null"]  # the preset's: the decay ends with the run
    run_dir = tmp_path / "run"
    out = cli(["train", "--preset", "llmjp4-8b", *[x for s in (f"run_dir={run_dir}", *COMMON_SETS, *sets)
                                                   for x in ("--set", s)]], tmp_path / "train")
    records = {r["step"]: r for r in trail(run_dir)}
    assert sorted(records) == [s for s in range(1, 41) if s not in (12, 13)]  # the skipped steps trained nothing
    assert [s for s in records if records[s]["lr"] != pytest.approx(3e-4, rel=1e-12)] == [1, 2, 3, 4, 5]
    assert (records[25]["global_batch_size"], records[26]["global_batch_size"]) == (8, 16)
    assert (records[19]["data_phase"], records[20]["data_phase"]) == (0, 1)
    assert (records[29]["precision"], records[30]["precision"]) == ("fp32", "fp8")
    assert records[40]["consumed_samples"] == 404
    marker = checkpoint.read_marker(run_dir, checkpoint.latest_tag(run_dir))
    cfg = build_config(marker.run_config)
    # the schedule's decay (in samples) ends where the run does: the LR of a step after the last is the minimum
    assert marker.lr_schedule["lr_decay_steps"] == 404 and run_schedule(cfg).lr(40, 404) == pytest.approx(3e-5)
    plan = next(line for line in out.stdout.splitlines() if "plan:" in line)
    assert ("stable to step 39 (388 samples), linear decay to step 40 (404 samples), LR 0.0003 at step 40" in plan
            and "batch 16 from step 26 (after 164 samples)" in plan and "data.phases[0] from step 20" in plan), plan
