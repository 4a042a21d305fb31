"""Every writer of the project on a full disk: ``llmjp-ds export`` (over an earlier export, with --force),
``import-megatron``, ``branch``, ``samples``, ``plot`` and ``health --plot`` (a full disk while a training writes its
record or its checkpoints: test_disk_gone.py and test_bad_inputs.py; preprocess: test_data_failures.py). Each on a
tmpfs the test mounts and fills (skipped with the reason where mounting is not allowed): one ``error:`` line naming
the path and the space left, no traceback, nothing of the output left (no temp file or directory), every file there
before byte-identical; and once the space is back, the same command succeeds."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

from tests import disk
from tests.reliability.conftest import check_ok, run

# torch's zip writer says only that a write came up short ("unexpected pos"), as it does for every torch.save
NO_SPACE = ("(No space left on device (ENOSPC); ", "(a write was cut short; ")


def cli(*args) -> list[str]:
    return [sys.executable, "-m", "llmjp_ds.cli", *map(str, args)]


def files(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` but the filler."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != ".filler"}


def refused_on_a_full_disk(d: Path, argv: list[str], path: Path, advice: str, leave: int = 0) -> str:
    """Run ``argv`` with ``d`` filled to ``leave`` bytes: its one line (about ``path``, ending in ``advice``), and
    everything under ``d`` as it was, nothing added; then, the space back, the same command succeeds."""
    before = files(d)
    entries = sorted(p.name for p in d.iterdir())
    filler = disk.fill(d, leave=leave)
    result = run(argv)
    out = result.stdout + result.stderr
    lines = [line for line in out.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(lines) == 1 and "Traceback" not in out, out[-3000:]
    assert any(lines[0].startswith(f"error: cannot write {path} {why}") for why in NO_SPACE), lines[0]
    assert " free there): " in lines[0] and lines[0].endswith(advice), lines[0]
    assert files(d) == before and sorted(p.name for p in d.iterdir()) == sorted([*entries, ".filler"])
    filler.unlink()
    check_ok(run(argv))
    print(lines[0])
    return lines[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_export_over_an_earlier_export(baseline, tmp_path):
    with disk.tmpfs(tmp_path / "disk", "32m") as d:
        out = d / "hf"
        check_ok(run(cli("export", "--run", baseline[0], "--output", out)))
        refused_on_a_full_disk(d, cli("export", "--run", baseline[0], "--output", out, "--force"), out,
                               "free space or choose another --output, then export again; what was at --output is "
                               "as it was", leave=256 << 10)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_branch(baseline, tmp_path):
    with disk.tmpfs(tmp_path / "disk", "64m") as d:
        (d / "other").write_text("someone else's file")
        refused_on_a_full_disk(d, cli("branch", "--from", baseline[0], "--run", d / "branch", "--set",
                                      "train.steps=40"), d / "branch",
                               "free space or choose another --run, then run it again; nothing was written",
                               leave=1 << 20)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_import_megatron(tmp_path):
    from tests.train.test_import_megatron import CANONICAL, fixture_info, import_sets

    sets = [x for s in import_sets(tmp_path, fixture_info(CANONICAL)) for x in ("--set", s)]
    with disk.tmpfs(tmp_path / "disk", "16m") as d:
        refused_on_a_full_disk(d, cli("import-megatron", "--load", CANONICAL / "save", "--run", d / "imported",
                                      *sets), d / "imported",
                               "free space or choose another --run, then run it again; nothing was written",
                               leave=64 << 10)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("verb", ["plot", "health", "samples"])
def test_plot_report_and_samples(baseline, tmp_path, verb):
    with disk.tmpfs(tmp_path / "disk", "4m") as d:
        out = d / ("windows.npy" if verb == "samples" else "curve.png")
        argv = {"plot": cli("plot", baseline[0], "--output", out),
                "health": cli("health", baseline[0], "--plot", out),
                "samples": cli("samples", "--run", baseline[0], "--start", 0, "--count", 64, "--output", out)}[verb]
        advice = ("free space or choose another --output, then run it again" if verb == "samples" else
                  f"choose another {'--plot' if verb == 'health' else '--output'}, or free space or fix the "
                  f"permissions of {d}")
        refused_on_a_full_disk(d, argv, out, advice)
