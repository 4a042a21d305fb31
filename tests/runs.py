"""The trainer's CPU acceptance runs (several processes over gloo), shared by ``tests/train/`` and
``tests/parallel/`` (their fixtures are registered in ``tests/conftest.py``); launched through :mod:`tests.launch`.

* ``train_env`` (session): one ``LLMJP_DS_CACHE`` for the session, so the bundled corpus and tokenizer are
  prepared once (~40 s), and a stable ``TORCH_EXTENSIONS_DIR`` (``$TORCH_EXTENSIONS_DIR`` if set, else
  ``~/.cache/llmjp-ds/torch_extensions``), so DeepSpeed's ``deepspeed_shm_comm`` op compiles once (~22 s), not
  once per session or per process. Both are warmed before the first run, so no test pays for them mid-run.
* :func:`run_train` trains the tiny fp32 model of :data:`COMMON_SETS` in 1 or N processes
  (:func:`tests.launch.train_argv`), failing the test with the stderr tail on a non-zero exit or a timeout.
* ``runs`` (session): the uninterrupted ``2N``-step run and the ``N`` + resume-to-``2N`` run of each parallel
  layout, each launched at most once per session and shared by the resume, equivalence and export tests
  (10 uninterrupted runs + 3 resumed pairs: 9 two-process launches, 4 four-process launches and 3 one-process
  launches in all).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.launch import CLI_TIMEOUT, free_port, run_command, subprocess_env, train_argv

N = 3  # the resume point; every run's LR schedule spans 2N steps (optim.decay_steps), so stopping at N is harmless
STEPS = 2 * N
TRAIN_TIMEOUT = 300  # seconds per launch (a 2-process run takes ~15 s on 2 idle cores)

TINY_MODEL = "{hidden_size: 64, num_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, ffn_hidden_size: 128}"
# vocab stays at the tiny preset's 8064 rows: the bundled tokenizer has 8000 pieces
COMMON_SETS = (
    "logging.wandb=disabled",
    f"model.overrides={TINY_MODEL}",
    "data.seq_len=32",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "precision.dtype=fp32",
    "train.eval_interval=0",
    f"optim.decay_steps={STEPS}",
    "optim.warmup_steps=2",
)

# layout -> (processes, extra --set values); the global batch (8) is the same in every layout
LAYOUTS = {
    "single": (1, ()),  # the reference: 1 process (ZeRO-1 over one rank, 4 micro-batches per step)
    "zero1": (2, ("parallel.zero_stage=1",)),
    "zero2": (2, ("parallel.zero_stage=2",)),
    "zero3": (2, ("parallel.zero_stage=3",)),
    "pp2": (2, ("parallel.zero_stage=1", "parallel.pipeline_stages=2")),
    "pp2-dp2": (4, ("parallel.zero_stage=1", "parallel.pipeline_stages=2")),  # the 172B layout's shape, small
    # tensor parallelism (sequence parallel by default), alone and with each other axis
    "tp2": (2, ("parallel.zero_stage=1", "parallel.tensor_parallel=2")),
    "tp2-pp2": (4, ("parallel.zero_stage=1", "parallel.tensor_parallel=2", "parallel.pipeline_stages=2")),
    "tp2-dp2": (4, ("parallel.zero_stage=1", "parallel.tensor_parallel=2")),
    "tp2-dp2-zero2": (4, ("parallel.zero_stage=2", "parallel.tensor_parallel=2")),
}

_WARM_UP = """
from llmjp_ds.data.plan import prepare_bundled
prepare_bundled()
from deepspeed.comm.torch import build_shm_op
build_shm_op()
"""


def run_train(tmp, nproc: int, *sets: str, timeout: float = TRAIN_TIMEOUT) -> Path:
    """Train in ``<tmp>/run`` (a second call with the same ``tmp`` resumes from ``latest``) with the tiny fp32
    setup of :data:`COMMON_SETS` plus ``sets``; returns the run directory. Needs the ``train_env`` fixture."""
    if "LLMJP_DS_CACHE" not in os.environ:
        raise RuntimeError("run_train needs the train_env fixture (LLMJP_DS_CACHE unset)")
    tmp = Path(tmp)
    run_dir = tmp / "run"
    port = free_port()
    # one process gets its port in the environment (the trainer would pick one), ranks from the launch
    env = subprocess_env(MASTER_PORT=port) if nproc == 1 else subprocess_env()
    launches = len(list(tmp.glob("train-*.err"))) if tmp.is_dir() else 0
    run_command(train_argv(run_dir, COMMON_SETS, *sets), tmp / f"train-{launches + 1:02d}", env=env,
                timeout=timeout, nproc=nproc, port=port)
    return run_dir


def cli(args: list[str], log_prefix: Path, *, check: bool = True, timeout: float = CLI_TIMEOUT, env=None):
    """``llmjp-ds <args>`` (the console script's entry point, through this interpreter)."""
    return run_command([sys.executable, "-m", "llmjp_ds.cli", *args], log_prefix, env=env, timeout=timeout,
                       check=check)


def trail(run_dir) -> list[dict]:
    """The current step records (not events) of a run's metrics.jsonl, in step order: each step as its latest
    attempt logged it, no step a resume or a rollback went back over (llmjp_ds/metrics/record.py)."""
    from llmjp_ds.metrics.record import trail as current_trail

    return current_trail(run_dir)


def losses(run_dir) -> list[float]:
    return [r["loss"] for r in trail(run_dir)]


def max_rel_diff(values, reference) -> float:
    assert len(values) == len(reference)
    return max(abs(a - b) / abs(b) for a, b in zip(values, reference))


@pytest.fixture(scope="session")
def train_env(tmp_path_factory):
    """The session's corpus/tokenizer cache and DeepSpeed extensions dir (in ``os.environ`` for the session)."""
    root = tmp_path_factory.mktemp("train-env")
    extensions = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "llmjp-ds" / "torch_extensions")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMJP_DS_CACHE", str(root / "cache"))
        mp.setenv("TORCH_EXTENSIONS_DIR", extensions)
        run_command([sys.executable, "-c", _WARM_UP], root / "warm-up", timeout=600)
        yield root


class Runs:
    """Each layout's uninterrupted run and resumed run, launched on first use and shared for the session.
    A failed launch is remembered, so the tests that share it fail at once instead of relaunching it."""

    def __init__(self, root: Path):
        self.root = root
        self._done: dict[tuple[str, str], Path | str] = {}

    def _get(self, kind: str, layout: str, launch) -> Path:
        key = (kind, layout)
        if key not in self._done:
            self._done[key] = "failed"
            try:
                self._done[key] = launch()
            except BaseException as exc:
                self._done[key] = f"{kind} run of {layout} failed earlier: {str(exc)[:3000]}"
                raise
        value = self._done[key]
        if isinstance(value, str):
            pytest.fail(value, pytrace=False)
        return value

    def full(self, layout: str) -> Path:
        """``2N`` steps in one go."""
        nproc, sets = LAYOUTS[layout]
        return self._get("full", layout, lambda: run_train(self.root / f"{layout}-full", nproc, *sets,
                                                           f"train.steps={STEPS}"))

    def resumed(self, layout: str) -> Path:
        """``N`` steps, stop (final save), then the same command with ``train.steps=2N``: resumes from latest."""
        nproc, sets = LAYOUTS[layout]

        def launch():
            tmp = self.root / f"{layout}-resumed"
            run_train(tmp, nproc, *sets, f"train.steps={N}")
            return run_train(tmp, nproc, *sets, f"train.steps={STEPS}")

        return self._get("resumed", layout, launch)


@pytest.fixture(scope="session")
def runs(train_env, tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("runs"))


class Exports:
    """``llmjp-ds export --dtype fp32`` of each layout's uninterrupted run, once per session."""

    def __init__(self, runs: Runs, root: Path):
        self.runs, self.root = runs, root
        self._done: dict[str, tuple[Path, str] | str] = {}

    def __call__(self, layout: str) -> tuple[Path, str]:
        """(export dir, the CLI's stdout)."""
        if layout not in self._done:
            run_dir = self.runs.full(layout)
            out = self.root / layout
            self._done[layout] = f"export of {layout} failed earlier"
            result = cli(["export", "--run", str(run_dir), "--output", str(out), "--dtype", "fp32"],
                         self.root / f"export-{layout}")
            self._done[layout] = (out, result.stdout)
        value = self._done[layout]
        if isinstance(value, str):
            pytest.fail(value, pytrace=False)
        return value


@pytest.fixture(scope="session")
def exports(runs, tmp_path_factory) -> Exports:
    return Exports(runs, tmp_path_factory.mktemp("exports"))


def read_json(path) -> dict:
    return json.loads(Path(path).read_text())


FLIP_AT = N  # the first FP8 step, as its record shows it: a resume at N restarts after one FP8 step
BF16_STEPS = FLIP_AT - 1  # the steps before it
FLIP = (f"precision.phases=[{{precision: bf16}}, {{precision: fp8, start_step: {FLIP_AT}, recipe: delayed, "
        "amax_history_len: 4, calibration_steps: 1}]",
        "precision.emulate_fp8=true")


@pytest.fixture(scope="session")
def flip_runs(train_env, tmp_path_factory) -> tuple[Path, Path, Path]:
    """The emulated BF16 -> FP8 flip at step ``FLIP_AT``: one process, two pipeline stages, and two pipeline
    stages stopped at ``N`` and resumed (uninterrupted single, pp2, resumed pp2 run directories)."""
    root = tmp_path_factory.mktemp("flip-layouts")
    pp2 = ("parallel.pipeline_stages=2",)
    single = run_train(root / "single", 1, *FLIP, f"train.steps={STEPS}")
    pipe = run_train(root / "pp2", 2, *pp2, *FLIP, f"train.steps={STEPS}")
    run_train(root / "pp2-resumed", 2, *pp2, *FLIP, f"train.steps={N}")
    resumed = run_train(root / "pp2-resumed", 2, *pp2, *FLIP, f"train.steps={STEPS}")
    return single, pipe, resumed
