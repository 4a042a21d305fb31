"""Helpers of the reliability tests: real CLI subprocesses on a tiny fp32 model, their metrics, kills.

Every training here is a subprocess (``python -m llmjp_ds.train``, started through :mod:`tests.launch`), as a
user or a scheduler would start it, on the bundled corpus (prepared once into ``$LLMJP_DS_CACHE``, default
``~/.cache/llmjp-ds``) with a 2-layer, 64-wide model, fp32, one process: deterministic to the bit, so a resumed
run must log exactly the losses of an uninterrupted one. A start costs ~6 s (torch, transformers, DeepSpeed), so the tests keep the number of runs
small. Processes are started in their own session and killed by process group (the preprocess pool's workers
die with their parent, as on a lost node).
"""

from __future__ import annotations

import json
import math
import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests import launch
from tests import forkserver
from tests.launch import REPO, run, subprocess_env

__all__ = ["REPO", "run", "subprocess_env"]  # the suite's launcher (tests/launch.py), imported from here too

# the tiny fp32 run every reliability test trains (bundled corpus and tokenizer; vocab 8064 >= its 8000 pieces)
TINY = [
    "model.overrides={hidden_size: 64, num_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, "
    "ffn_hidden_size: 128}",
    "data.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2", "precision.dtype=fp32",
    "train.eval_interval=0", "logging.wandb=disabled", "logging.progress=true", "optim.warmup_steps=2",
    # the LR decay over 30 steps whatever train.steps: a run resumed to more steps keeps its schedule, which the
    # resume checks (optim.resume_schedule)
    "optim.decay_steps=30",
]
# the run the kill drill and the preemption test compare against (uninterrupted, same steps => same LR schedule)
DRILL_STEPS = 30
DRILL = TINY + [f"train.steps={DRILL_STEPS}", "checkpoint.interval=1", "checkpoint.keep_last=2"]

# deepspeed.init_distributed logs this; its absence shows an error came before any process group existed
DEEPSPEED_STARTED = ("Initializing TorchBackend", "[rank0]", "deepspeed_shm_comm")


def train_argv(run_dir, sets=DRILL, *more: str) -> list[str]:
    return launch.train_argv(run_dir, sets, *more)


def run_train(run_dir, sets=DRILL, *more: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return run(train_argv(run_dir, sets, *more), timeout=timeout)


def check_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


class Proc:
    """A started subprocess (own session) whose stdout lines are read by a thread into a queue."""

    def __init__(self, argv, env=None, cwd=REPO, fresh: bool = False):
        self.t0 = time.monotonic()
        self.p = forkserver.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env or subprocess_env(),
                                  cwd=cwd, fresh=fresh)
        self.lines: list[str] = []
        self._q: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.p.stdout:
            self._q.put(line)

    def drain(self) -> list[str]:
        new = []
        while True:
            try:
                new.append(self._q.get_nowait())
            except queue.Empty:
                self.lines += new
                return new

    def steps_done(self) -> int:
        """The highest ``step N/M`` progress line this process has printed (0 before the first)."""
        self.drain()
        done = [int(line.split()[1].split("/")[0]) for line in self.lines if line.startswith("step ")]
        return max(done, default=0)

    def alive(self) -> bool:
        return self.p.poll() is None

    def signal(self, sig: int) -> None:
        os.killpg(self.p.pid, sig)  # the process group we created: this process and its children only

    def kill(self) -> None:
        if self.alive():
            self.signal(signal.SIGKILL)
        self.wait(60)

    def wait(self, timeout: float) -> int:
        rc = self.p.wait(timeout)
        self._reader.join(10)
        self.drain()
        return rc

    def output(self) -> str:
        self.drain()
        return "".join(self.lines)

    def __del__(self):
        if getattr(self, "p", None) is not None and self.p.poll() is None:
            with __import__("contextlib").suppress(ProcessLookupError):
                os.killpg(self.p.pid, signal.SIGKILL)


def wait_for(predicate, proc: Proc | None = None, timeout: float = 120, interval: float = 0.001):
    """Poll ``predicate`` until it returns a truthy value; None if ``proc`` exits first or on timeout."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        if proc is not None and not proc.alive():
            return predicate() or None
        time.sleep(interval)
    return None


# --- what a run left behind -------------------------------------------------------------------------------

def read_records(run_dir) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line torn by a kill
    return out


def loss_trail(run_dir) -> dict[int, float]:
    """The current loss of each step: a resumed run logs the steps after its checkpoint again, and the record keeps
    both, each marked by its attempt (llmjp_ds/metrics/record.py)."""
    from llmjp_ds.metrics.record import current_steps

    return {step: r["loss"] for step, r in current_steps(read_records(run_dir)).items() if "loss" in r}


def events(run_dir, name: str) -> list[dict]:
    return [r for r in read_records(run_dir) if r.get("event") == name]


def latest_of(run_dir) -> str | None:
    path = Path(run_dir) / "checkpoints" / "latest"
    return path.read_text().strip() if path.is_file() else None


def tag_step(tag: str) -> int:
    return int(tag[4:12])


def assert_latest_complete(run_dir) -> str | None:
    """``latest`` (if any) names a complete checkpoint, and so does every other tag with a marker (export
    ``--tag`` and the FP8 rollback trust markers): marker valid, DeepSpeed's files loadable, weights finite."""
    root = Path(run_dir) / "checkpoints"
    for d in sorted(root.glob("step*")) if root.is_dir() else []:
        if (d / "llmjp_ds.json").is_file():
            assert_tag_complete(run_dir, d.name)
    tag = latest_of(run_dir)
    if tag is not None:
        assert_tag_complete(run_dir, tag)
    return tag


def assert_tag_complete(run_dir, tag: str) -> None:
    import torch

    d = Path(run_dir) / "checkpoints" / tag
    marker = d / "llmjp_ds.json"
    assert marker.is_file(), f"{tag} has no marker: {sorted(os.listdir(d)) if d.is_dir() else 'gone'}"
    info = json.loads(marker.read_text())
    assert info["tag"] == tag and info["step"] == tag_step(tag)
    model = torch.load(d / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    assert model["module"] and all(torch.isfinite(t).all() for t in model["module"].values() if t.is_floating_point())
    assert model["train_state"]["step"] == info["step"]
    # the optimizer state: ZeRO-1+ in its own file, ZeRO-0 inside the model states
    optim_files = list(d.glob("*optim_states.pt"))
    optim = torch.load(optim_files[0], map_location="cpu", weights_only=False) if optim_files else model
    assert optim.get("optimizer_state_dict") or optim.get("optimizer"), sorted(optim)


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


# --- fixtures ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def bundled():
    """(a corpus prefix, tokenizer dir) of the bundled corpus, built once into the cache the subprocesses share
    (~40 s on a cold cache on 2 cores; a CI job should cache $LLMJP_DS_CACHE)."""
    from llmjp_ds.data.plan import prepare_bundled

    blend, tokenizer = prepare_bundled()
    return blend[0][1], Path(tokenizer)


@pytest.fixture(scope="session")
def baseline(bundled, tmp_path_factory):
    """An uninterrupted DRILL run: its run dir and loss trail (steps 1..DRILL_STEPS)."""
    run_dir = tmp_path_factory.mktemp("baseline") / "run"
    result = run_train(run_dir, DRILL)
    check_ok(result)
    trail = loss_trail(run_dir)
    assert sorted(trail) == list(range(1, DRILL_STEPS + 1)) and all(map(finite, trail.values())), trail
    return run_dir, trail
