"""What a training step reports: throughput and MFU, peak memory, and the metrics trail (jsonl + wandb).

The trail of a run is ``<run_dir>/metrics.jsonl``: one JSON object per line, written by rank 0 only, flushed
per line, ``{"step": int, "time": unix seconds, <metric>: value, ...}`` for steps and
``{"step": int, "time": ..., "event": name, <field>: value, ...}`` for events (``rollback``, ``precision_flip``,
``resume`` ...), each with its ``attempt``. The file only grows: a resume or a rollback appends, and readers take
each step's current record (:mod:`llmjp_ds.metrics.record`). Metric names the rest of the package uses: ``loss``,
``z_loss``, ``valid_loss``, ``lr``, ``grad_norm``, ``tokens_per_s``, ``tflops_per_gpu``, ``mfu``,
``peak_memory_gib``, ``step_time_s`` and ``phase`` (the precision phase, a string such as ``"bf16"`` or ``"fp8"``).
NaN losses are written as ``NaN`` (Python's json reads them back).

The same records go to wandb (offline by default; ``disabled`` never imports wandb). wandb's own step counter
must only grow, and a resumed run restarts from a checkpoint *behind* the last step the killed run logged, so
every record carries ``step`` as a metric and wandb plots against it (``define_metric("*", step_metric="step")``)
instead of passing ``step=`` to ``wandb.log``, which would silently drop the replayed steps.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import secrets
import string
import sys
import time
from pathlib import Path
from typing import Any

from llmjp_ds.errors import fail
from llmjp_ds.io_utils import free_space, write_failure
from llmjp_ds.metrics.record import ATTEMPT_EVENT, METRICS_FILE, last_attempt

__all__ = [
    "PEAK_TFLOPS", "peak_tflops", "peak_flops_for_device", "Throughput", "peak_memory_gib", "reset_peak_memory",
    "MetricsLogger", "format_log_line", "WANDB_MODES",
]

WANDB_MODES = ("online", "offline", "disabled")

# Dense (no sparsity) peak tensor-core TFLOP/s per GPU from NVIDIA's data sheets, keyed by a fragment of
# `torch.cuda.get_device_name()`. Checked in order, so the more specific names come first.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 PCIE": {"bf16": 756.0, "fp8": 1513.0},
    "H100 NVL": {"bf16": 835.0, "fp8": 1670.0},
    "H200 NVL": {"bf16": 835.0, "fp8": 1670.0},
    "H100": {"bf16": 989.0, "fp8": 1979.0},  # SXM ("NVIDIA H100 80GB HBM3")
    "H200": {"bf16": 989.0, "fp8": 1979.0},  # SXM, and GH200
    "A100": {"bf16": 312.0},  # SXM and PCIe alike; no FP8 tensor cores
}


def peak_tflops(device_name: str, dtype: str = "bf16") -> float | None:
    """Peak dense TFLOP/s of the named device for ``dtype`` (``"bf16"`` or ``"fp8"``), None when unknown."""
    name = device_name.upper().replace("-", " ")
    for fragment, peaks in PEAK_TFLOPS.items():
        if fragment in name:
            return peaks.get(dtype)
    return None


def peak_flops_for_device(dtype: str = "bf16", device_name: str | None = None) -> float | None:
    """Peak FLOP/s of this process's CUDA device (or ``device_name``); None on CPU or an unknown GPU.

    MFU is quoted against the **BF16** peak in every precision phase (as LLM-jp and NVIDIA report the 172B run:
    ~400 TFLOP/s BF16, ~550 FP8), so the BF16 -> FP8 flip shows up as a rise in MFU.
    """
    if device_name is None:
        torch = sys.modules.get("torch")  # a run that never imported torch has no GPU in use
        if torch is None or not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name()
    tflops = peak_tflops(device_name, dtype)
    return None if tflops is None else tflops * 1e12


class Throughput:
    """Tokens/s, model TFLOP/s per GPU and MFU of a step.

    ``tokens_per_step`` is the global batch in tokens (global batch x sequence length); ``flops_per_token`` the
    training FLOPs of :func:`llmjp_ds.model.flops.model_flops_per_token`. ``peak_flops`` (FLOP/s per GPU)
    defaults to the device's BF16 peak; with none known, ``mfu`` is left out of the result.
    """

    _AUTO = object()

    def __init__(self, flops_per_token: float, tokens_per_step: int, world_size: int = 1,
                 peak_flops: float | None | object = _AUTO):
        if flops_per_token <= 0 or tokens_per_step <= 0 or world_size <= 0:
            raise ValueError("flops_per_token, tokens_per_step and world_size must be positive")
        self.flops_per_token = float(flops_per_token)
        self.tokens_per_step = int(tokens_per_step)
        self.world_size = int(world_size)
        self.peak_flops = peak_flops_for_device() if peak_flops is Throughput._AUTO else peak_flops

    def update(self, step_seconds: float, tokens: int | None = None) -> dict[str, float]:
        """The rates of a step of ``step_seconds`` that read ``tokens`` (default ``tokens_per_step``; a ramped
        batch reads fewer)."""
        if step_seconds <= 0:
            raise ValueError(f"step_seconds must be positive, got {step_seconds}")
        tokens_per_s = (self.tokens_per_step if tokens is None else tokens) / step_seconds
        flops_per_gpu = self.flops_per_token * tokens_per_s / self.world_size
        out = {"tokens_per_s": tokens_per_s, "tflops_per_gpu": flops_per_gpu / 1e12}
        if self.peak_flops:
            out["mfu"] = flops_per_gpu / self.peak_flops
        return out


def peak_memory_gib() -> float:
    """Peak memory of this process in GiB: CUDA ``max_memory_allocated`` when a GPU is in use, else max RSS.

    On CPU the figure is the OS's lifetime maximum resident set, which :func:`reset_peak_memory` cannot reset.
    """
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**30

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20  # bytes on macOS, KiB on Linux


def reset_peak_memory() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


def _new_run_id() -> str:
    # The alphabet and length of wandb.util.generate_id, without importing wandb.
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def _plain(value: Any) -> Any:
    """A JSON-ready value: tensors and numpy scalars become Python numbers."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def _scalars(values: dict) -> dict:
    """What wandb plots of a record: its scalars, a list of numbers as ``<key>/<index>``; a nested list (a whole
    matrix of the record) is the jsonl's only."""
    out = {}
    for key, value in values.items():
        if not isinstance(value, list):
            out[key] = value
        elif all(isinstance(v, (int, float)) for v in value):
            out.update({f"{key}/{i}": v for i, v in enumerate(value)})
    return out


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


class MetricsLogger:
    """Rank 0's metrics trail: ``<run_dir>/metrics.jsonl`` plus a wandb run; other ranks do nothing.

    The file only grows (:mod:`llmjp_ds.metrics.record`): a process that finds records there is a new attempt,
    going on from ``step`` (its checkpoint's step; 0 afresh), and says so with an ``attempt`` event; a rollback is
    one too (:meth:`new_attempt`). ``run_id`` resumes that wandb run (``resume="allow"``); without it a fresh id is
    drawn even when wandb is disabled, so the trainer can store ``logger.run_id`` in its checkpoint and a resumed
    run keeps the id. wandb files go to ``<run_dir>/wandb/`` (``WANDB_DIR`` is set to ``run_dir``, under which
    wandb makes its own ``wandb/`` directory).

    ``guard`` is called before each write (the run directory's lock: it ends the run with one line when the
    directory is no longer the one it locked). A write that fails (a full disk) leaves nothing of its line, and
    the logger writes no more: :attr:`failure` says what failed, for the trainer to end the run on.
    """

    def __init__(self, run_dir: str | os.PathLike, *, wandb_mode: str = "offline", project: str = "llmjp-ds",
                 run_name: str | None = None, run_id: str | None = None, config: dict | None = None,
                 step: int = 0, rank: int = 0, guard=None):
        if wandb_mode not in WANDB_MODES:
            fail(f"wandb mode must be one of {', '.join(WANDB_MODES)}, got {wandb_mode!r}")
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.rank = rank
        self.wandb_mode = wandb_mode
        self.failure: str | None = None  # the write that failed, in words
        self.attempt = 0
        self._guard = guard
        self._fd: int | None = None
        self._wandb_run = None
        self._run_id = run_id
        if rank != 0:
            return
        if self._run_id is None:
            self._run_id = _new_run_id()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.attempt = last_attempt(self.path) + 1
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if os.fstat(self._fd).st_size and not _ends_with_newline(self.path):
            self._write_raw("\n")  # end a line torn by a killed run before appending after it
        if self.attempt > 1:
            self.event(step, ATTEMPT_EVENT, reason="resume" if step else "restart")
        if wandb_mode != "disabled":
            try:
                self._wandb_run = self._start_wandb(project, run_name, config, resumed=run_id is not None)
            except ImportError:
                self.close()
                fail(f"wandb ({wandb_mode}) did not start: wandb is not installed; pip install wandb, or set "
                     "logging.wandb=disabled")
            except Exception as exc:  # e.g. online without a login, or no network
                self.close()
                reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                fail(f"wandb ({wandb_mode}) did not start: {reason}; log offline or disabled instead")

    def _start_wandb(self, project: str, run_name: str | None, config: dict | None, resumed: bool):
        # wandb needs its directory to exist before init; it writes its runs to <WANDB_DIR>/wandb/.
        (self.run_dir / "wandb").mkdir(exist_ok=True)
        os.environ["WANDB_DIR"] = str(self.run_dir.resolve())
        import wandb

        run = wandb.init(
            project=project, name=run_name, id=self._run_id, resume="allow" if resumed else None,
            config=_plain(config or {}), mode=self.wandb_mode, dir=str(self.run_dir.resolve()),
            settings=wandb.Settings(quiet=True),  # the trainer prints its own log line; no run summary dump
        )
        run.define_metric("step")
        run.define_metric("*", step_metric="step")
        return run

    @property
    def run_id(self) -> str | None:
        """The wandb run id (also when wandb is disabled); on ranks other than 0, the id passed in or None."""
        return self._run_id

    @property
    def active(self) -> bool:
        return self._fd is not None and self.failure is None

    def _write_raw(self, text: str) -> None:
        """Append ``text`` whole or not at all (a failed write's part is cut off again)."""
        if self._guard is not None:
            self._guard()
        data = text.encode("utf-8")
        size = os.fstat(self._fd).st_size
        try:
            while data:
                data = data[os.write(self._fd, data):]
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, size)
            self.failure = f"writing {self.path} failed ({write_failure(exc)}; {free_space(self.run_dir)} there)"

    def _write(self, record: dict) -> None:
        self._write_raw(json.dumps({**record, "attempt": self.attempt}) + "\n")

    def new_attempt(self, step: int, reason: str) -> None:
        """The run went back to its checkpoint of ``step`` (a rollback): what follows supersedes the step records
        after it."""
        if self.active:
            self.attempt += 1
            self.event(step, ATTEMPT_EVENT, reason=reason)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """One step's metrics; ``step`` is the optimizer step the metrics belong to."""
        if not self.active:
            return
        values = {k: _plain(v) for k, v in metrics.items() if k not in ("step", "time", "attempt")}
        self._write({"step": int(step), "time": round(time.time(), 3), **values})
        if self._wandb_run is not None:
            self._wandb_run.log({"step": int(step), **_scalars(values)})

    def event(self, step: int, name: str, **fields: Any) -> None:
        """Something that happened once (``rollback``, ``precision_flip`` ...): a jsonl record, a wandb point
        ``event/<name> = 1`` at ``step``, and ``last_event/<name>`` in the wandb summary with its fields."""
        if not self.active:
            return
        fields = {k: _plain(v) for k, v in fields.items() if k not in ("step", "time", "event", "attempt")}
        self._write({"step": int(step), "time": round(time.time(), 3), "event": name, **fields})
        if self._wandb_run is not None:
            self._wandb_run.log({"step": int(step), f"event/{name}": 1})
            self._wandb_run.summary[f"last_event/{name}"] = {"step": int(step), **fields}

    def close(self, exit_code: int = 0) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._wandb_run is not None:
            run, self._wandb_run = self._wandb_run, None
            run.finish(exit_code=exit_code)

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exit_code=0 if exc_type is None else 1)


def _si(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.3g}"


# the log line's fields after the loss, in order: metric key -> its text
_LOG_FIELDS = (
    ("valid_loss", lambda v: f"valid {v:.4f}"),
    ("fp8_penalty", lambda v: f"FP8 penalty {100 * v:+.3f}%"),
    ("lr", lambda v: f"lr {v:.2e}"),
    ("grad_norm", lambda v: f"gnorm {v:.3f}"),
    ("tokens_per_s", lambda v: f"{_si(v)} tok/s"),
    ("tflops_per_gpu", lambda v: f"{v:.1f} TFLOP/s"),
    ("mfu", lambda v: f"MFU {100 * v:.1f}%"),
    ("peak_memory_gib", lambda v: f"mem {v:.1f} GiB"),
)


def format_log_line(step: int, total_steps: int | None, metrics: dict[str, Any]) -> str:
    """A compact human log line, e.g.
    ``step 120/1000 | loss 3.4521 z 1.2e-04 | lr 2.50e-04 | gnorm 0.870 | 12.3k tok/s | 401.2 TFLOP/s | MFU 40.6%
    | mem 45.3 GiB | bf16`` (an MoE model's: ``loss 3.4521 z 1.2e-04 aux 1.024 | ...``); metrics that are absent are
    left out."""
    def num(key: str) -> float | None:
        value = metrics.get(key)
        if value is None or isinstance(value, str):
            return None
        return float(value.item() if hasattr(value, "item") else value)

    width = len(str(total_steps)) if total_steps else 0
    parts = [f"step {step:>{width}}/{total_steps}" if total_steps else f"step {step}"]
    loss = num("loss")
    if loss is not None:
        text = f"loss {loss:.4f}" if math.isfinite(loss) else f"loss {loss}"
        if num("z_loss") is not None:
            text += f" z {num('z_loss'):.2e}"
        if num("moe_aux_loss") is not None:  # an MoE model's load-balancing loss: 1 when evenly balanced
            text += f" aux {num('moe_aux_loss'):.3f}"
        parts.append(text)
    if metrics.get("skipped"):  # the health gate skipped the update: no gradient norm to show
        parts.append(f"update skipped ({metrics['skipped']})")
    for key, show in _LOG_FIELDS:
        value = num(key)
        if value is not None:
            parts.append(show(value))
    if metrics.get("phase"):
        parts.append(str(metrics["phase"]) + (" (emulated)" if metrics.get("emulated_fp8") else ""))
    return " | ".join(parts)
