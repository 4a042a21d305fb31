"""The parity check's report (benchmarks/parity/__main__.py) on the H200's raw curves in docs/perf-raw: run AE's and
run AF's calls give docs/performance.md's figures, each run from A's checkpoint compared only within its own call."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.parity import __main__ as harness
from llmjp_ds.curves import _ITERATION

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
