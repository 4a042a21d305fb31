"""The parity check's report (benchmarks/parity/__main__.py) on the H200's raw curves in docs/perf-raw: run AE's two
calls give docs/performance.md's figures, each run from A's checkpoint compared only within its own call."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.parity.__main__ import main

RAW = Path(__file__).resolve().parents[1] / "docs" / "perf-raw"


def rows(out: Path) -> dict[str, list[str]]:
    lines = (out / "summary-parity.md").read_text().splitlines()
    return {cells[1].strip(): [c.strip() for c in cells[2:-1]]
            for line in lines if line.startswith("| ") and len(cells := line.split("|")) == 9}


@pytest.mark.parametrize("order", [("continued", "spreads"), ("spreads", "continued")])
def test_run_ae_gives_the_documented_gaps(order, tmp_path):
    calls = [RAW / "run-ae" / name for name in order] + [RAW / "run-ad"]
    assert main(["--report-from", *map(str, calls), "--out", str(tmp_path)]) == 0
    got = rows(tmp_path)
    fp8, round_trip = "FP8 from the flip (both from A's checkpoint)", "round trip: A imported at the flip, BF16"
    assert got[fp8] == ["0.0039", "0.0056", "0.69", "+0.033 %", "-0.094 %", "yes"]
    assert got[round_trip] == ["0.0030", "0.0053", "0.57", "+0.060 %", "+0.069 %", "yes"]
    assert got["BF16, 1..end (against B, uninterrupted like ours)"][:3] == ["0.1068", "0.1096", "0.97"]
    assert all((tmp_path / png).read_bytes()[:4] == b"\x89PNG" for png in
               ("parity-bf16.png", "parity-fp8.png", "parity-roundtrip.png"))


def test_a_run_from_a_checkpoint_is_never_compared_across_calls(tmp_path):
    """The continuing call alone has ours and Megatron's continuation but no spread; the spreads' call alone has no
    ours: neither is reported, though together they are."""
    for call in ("continued", "spreads"):
        assert main(["--report-from", str(RAW / "run-ae" / call), "--out", str(tmp_path / call)]) == 0
        got = rows(tmp_path / call)
        assert got["FP8 from the flip (both from A's checkpoint)"][0] == "not run"
        assert got["round trip: A imported at the flip, BF16"][0] == "not run"
