"""The GPU checks' runner (benchmarks/device/run.sh) on CPU: every listed check has its file and every file its
line, a dry run prints each check's commands and runs and writes nothing, the paths they name exist, no text of
the project points at a device script that is gone, and the summaries' verdicts fail where they must."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEVICE = REPO / "benchmarks" / "device"
RUN = DEVICE / "run.sh"
CHECKS = sorted(p.stem for p in (DEVICE / "checks").glob("*.sh"))

# what a check's dry run must show it doing
COMMANDS = {
    "gpu-tests": ["python -m pytest -m gpu", " tests"],
    "bench": ["llmjp_ds.cli bench --shapes 172b-slice,llmjp3-1.8b", "peer-mcore-bf16", "peer-mcore-fp8-param",
              "ours-fp8-delayed"],
    "flow": ["deepspeed --hostfile", "--no_ssh_check", "llmjp_ds/train.py", "start_step: 6, recipe: delayed",
             "kill -TERM", "resume_summary.py", "--flip 6", "llmjp_ds.cli export", "generate_samples"],
    "kernels": ["test_kernel_rope.py", "kernel_bandwidth.py", "LLMJP_DS_FUSED_LOSS=compiled",
                "optim.fused_step=false"],
    "async": ["checkpoint.async_save=true", "async_summary.py", "kill -KILL", "resume_summary.py"],
    "cluster": ["mpirun -np 1", "llmjp_ds.cli preflight", "kill -USR1", "resume_summary.py"],
    "multi": ["deepspeed --hostfile", "parallel.zero_stage=3", "parallel.pipeline_stages=2",
              "parallel.tensor_parallel=2", "multi_summary.py", "llmjp_ds.cli export"],
    "parity": ["python -m benchmarks.parity --megatron-lm .megatron-lm", "--tokenizer .cache/tokenizer-v3.model"],
}


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(RUN), *args], capture_output=True, text=True, timeout=60, env=env)


def listed() -> list[str]:
    out = run().stdout.splitlines()[1:]
    return [line.split()[0] for line in out]


def test_every_listed_check_has_its_file_and_every_file_its_line():
    assert sorted(listed()) == CHECKS
    assert set(COMMANDS) <= set(CHECKS)
    assert all(re.search(r"\d+ min, \d GPU", line) for line in run().stdout.splitlines()[1:])


@pytest.mark.parametrize("check", CHECKS)
def test_dry_run_prints_the_commands_and_runs_nothing(check, tmp_path):
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "NGPU": "0"}
    result = run("--dry-run", check, env=env)
    assert result.returncode == 0, result.stderr
    commands = [line for line in result.stdout.splitlines() if line.startswith("+ ")]
    assert commands and all(text in result.stdout for text in COMMANDS.get(check, [])), result.stdout
    assert not (tmp_path / "out").exists()  # nothing written
    assert "verdict" in result.stdout and not result.stderr


def test_arguments_reach_the_checks_command():
    out = run("--dry-run", "bench", "--steps", "6", "--set", "model.attention_core=cudnn").stdout
    assert "peer-mcore-fp8-param --steps 6 --set model.attention_core=cudnn --json" in out


def test_the_health_row_runs_only_beside_a_1_8b_row():
    def health_row(*args):
        return "health.loss.action=skip" in run("--dry-run", "bench", *args).stdout

    assert health_row() and health_row("--shapes", "172b-slice,llmjp3-1.8b")
    assert not health_row("--shapes", "llmjp4-moe-slice", "--steps", "10")
    assert not health_row("--shapes=llmjp4-moe-slice")
    assert not health_row("--shapes", "llmjp3-1.8b", "--shapes", "llmjp4-moe-slice")  # the last one counts


def test_an_unknown_check_is_refused_in_one_line():
    result = run("benchmark")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "no check named 'benchmark'" in result.stderr and "run.sh" in result.stderr


def scripts() -> list[Path]:
    return [RUN, DEVICE / "lib.sh", *sorted((DEVICE / "checks").glob("*.sh"))]


def test_scripts_parse_and_pass_shellcheck():
    for path in scripts():
        assert subprocess.run(["bash", "-n", str(path)]).returncode == 0, path
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    result = subprocess.run(["shellcheck", "-s", "bash", *map(str, scripts())], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_every_path_the_checks_name_exists():
    text = "\n".join(p.read_text() for p in scripts())
    named = set(re.findall(r"\b((?:benchmarks|tests|hostfiles|llmjp_ds)/[\w./-]+\.(?:py|sh))\b", text))
    named |= set(re.findall(r"\bhostfiles/[\w.-]*\w", text))
    assert named and not [p for p in named if not (REPO / p).exists()]


def test_no_text_points_at_a_device_script_that_is_gone():
    """Docs may cite a retired script as `git show REV:benchmarks/device/NAME` (the command of that run); any other
    mention of benchmarks/device/NAME must name a file that exists."""
    gone = []
    for path in [REPO / "README.md", *REPO.glob("docs/*.md"), *REPO.glob("tests/**/*.py"),
                 *REPO.glob("benchmarks/**/*.py"), *scripts()]:
        for name in re.findall(r"(?<![:\w/])benchmarks/device/([a-z0-9_./-]*[a-z0-9_])", path.read_text()):
            if not (DEVICE / name).exists():
                gone.append(f"{path.relative_to(REPO)}: {name}")
    assert not gone


def write_metrics(run_dir: Path, losses: dict, events: list = ()) -> Path:
    run_dir.mkdir(parents=True)
    records = [{"step": s, "loss": loss, "grad_norm": 1.0, "phase": "bf16" if s <= 2 else "fp8-delayed-hybrid"}
               for s, loss in losses.items()] + list(events)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def summary(script: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DEVICE / script), *map(str, args)], capture_output=True, text=True,
                          timeout=60, cwd=REPO, env={"PYTHONPATH": str(REPO)})


def test_resume_summary_passes_a_faithful_resume_and_fails_a_drift(tmp_path):
    trail = {s: 10.0 - s / 10 for s in range(1, 7)}
    flip = [{"step": 2, "event": "precision_flip"}]
    resumed = flip + [{"step": 4, "event": "preempted", "tag": "step00000004", "reason": "SIGTERM"},
                      {"step": 4, "event": "resume", "tag": "step00000004"}]
    whole = write_metrics(tmp_path / "whole", trail, flip)
    same = write_metrics(tmp_path / "same", {**trail, 5: trail[5] * (1 + 1e-4)}, resumed)
    ok = summary("resume_summary.py", whole, same, "--flip", 2)
    assert ok.returncode == 0, ok.stdout
    assert "from step00000004 after step 4" in ok.stdout and "step00000004 on SIGTERM" in ok.stdout
    drift = write_metrics(tmp_path / "drift", {**trail, 6: trail[6] * 1.01}, resumed)
    missing = write_metrics(tmp_path / "missing", {s: v for s, v in trail.items() if s != 5}, resumed)
    never = write_metrics(tmp_path / "never", trail, flip)
    for bad, args in ((drift, ()), (missing, ()), (never, ()), (same, ("--flip", 3))):
        assert summary("resume_summary.py", whole, bad, *args).returncode == 1, bad


def test_multi_summary_fails_a_layout_that_drifts_or_did_not_run(tmp_path):
    trail = {s: 10.0 - s / 10 for s in range(1, 7)}
    for name, scale in (("single", 1.0), ("near", 1 + 1e-3), ("far", 1.05)):
        write_metrics(tmp_path / name, {s: v * scale for s, v in trail.items()})
    for run_dir in tmp_path.iterdir():
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        for r in lines:
            r.update(tokens_per_s=1000.0, tflops_per_gpu=100.0)
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert summary("multi_summary.py", 3, tmp_path / "single", f"{tmp_path / 'near'}:2").returncode == 0
    assert summary("multi_summary.py", 3, tmp_path / "single", f"{tmp_path / 'far'}:2").returncode == 1
    assert summary("multi_summary.py", 3, tmp_path / "single", f"{tmp_path / 'none'}:2").returncode == 1


def test_the_python_helpers_import_on_cpu():
    for name in ("async_summary", "kernel_bandwidth", "multi_summary", "resume_summary"):
        result = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=DEVICE, capture_output=True,
                                text=True, timeout=120, env={"PYTHONPATH": f"{REPO}:{DEVICE}"})
        assert result.returncode == 0, result.stderr
