"""What a training step reports: throughput and MFU, peak memory, and the metrics trail (jsonl + wandb).

The trail of a run is ``<run_dir>/metrics.jsonl``: one JSON object per line, written by rank 0 only, flushed
per line, ``{"step": int, "time": unix seconds, <metric>: value, ...}`` for steps and
``{"step": int, "time": ..., "event": name, <field>: value, ...}`` for events (``rollback``, ``precision_flip``,
``resume`` ...). Metric names the rest of the package uses: ``loss``, ``z_loss``, ``valid_loss``, ``lr``,
``grad_norm``, ``tokens_per_s``, ``tflops_per_gpu``, ``mfu``, ``peak_memory_gib``, ``step_time_s`` and
``phase`` (the precision phase, a string such as ``"bf16"`` or ``"fp8"``). NaN losses are written as ``NaN``
(Python's json reads them back).

The same records go to wandb (offline by default; ``disabled`` never imports wandb). wandb's own step counter
must only grow, and a resumed run restarts from a checkpoint *behind* the last step the killed run logged, so
every record carries ``step`` as a metric and wandb plots against it (``define_metric("*", step_metric="step")``)
instead of passing ``step=`` to ``wandb.log``, which would silently drop the replayed steps.
"""

from __future__ import annotations

import json
import math
import os
import resource
import secrets
import stat
import string
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from llmjp_ds.errors import fail

__all__ = [
    "PEAK_TFLOPS", "peak_tflops", "peak_flops_for_device", "Throughput", "peak_memory_gib", "reset_peak_memory",
    "MetricsLogger", "read_metrics", "format_log_line", "METRICS_FILE", "WANDB_MODES",
]

METRICS_FILE = "metrics.jsonl"
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


def parse_records(data: bytes) -> tuple[list[dict], int]:
    """The records of a metrics.jsonl's bytes in file order, and how many non-blank lines were skipped: a line
    cut short by a killed run, bytes that are not UTF-8 or not JSON, a value that is not an object with an
    integer step."""
    records, skipped = [], 0
    for raw in data.splitlines():
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            skipped += 1
            continue
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            skipped += 1
            continue
        records.append(record)
    return records, skipped


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The records of ``<run_dir>/metrics.jsonl`` in file order (unreadable lines, such as a torn last one,
    skipped)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        fail(f"no {METRICS_FILE} in {run_dir}: is it a run directory, and has the run logged a step yet?")
    return parse_records(path.read_bytes())[0]


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _truncate_after(path: Path, step: int) -> int:
    """Drop the records after ``step`` (left by a killed run) and any torn line, rewriting the file atomically
    (temp file, fsync, rename); return how many records were dropped."""
    if not path.is_file():
        return 0
    data = path.read_bytes()
    records, _ = parse_records(data)
    kept = [r for r in records if r["step"] <= step]
    if len(kept) == len(data.splitlines()):
        return 0  # nothing after `step`, no torn, unreadable or blank line: leave the file alone
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))  # keep the trail's mode, not mkstemp's 0600
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return len(records) - len(kept)


class MetricsLogger:
    """Rank 0's metrics trail: ``<run_dir>/metrics.jsonl`` plus a wandb run; other ranks do nothing.

    ``run_id`` resumes that wandb run (``resume="allow"``); without it a fresh id is drawn even when wandb is
    disabled, so the trainer can store ``logger.run_id`` in its checkpoint and a resumed run keeps the id.
    ``resume_step`` drops the records after that step (a killed run logged past its last checkpoint), so the
    trail has each step once. wandb files go to ``<run_dir>/wandb/`` (``WANDB_DIR`` is set to ``run_dir``,
    under which wandb makes its own ``wandb/`` directory).
    """

    def __init__(self, run_dir: str | os.PathLike, *, wandb_mode: str = "offline", project: str = "llmjp-ds",
                 run_name: str | None = None, run_id: str | None = None, config: dict | None = None,
                 resume_step: int | None = None, rank: int = 0):
        if wandb_mode not in WANDB_MODES:
            fail(f"wandb mode must be one of {', '.join(WANDB_MODES)}, got {wandb_mode!r}")
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.wandb_mode = wandb_mode
        self.dropped = 0  # records removed by resume_step
        self._file = None
        self._wandb_run = None
        self._run_id = run_id
        if rank != 0:
            return
        if self._run_id is None:
            self._run_id = _new_run_id()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / METRICS_FILE
        if resume_step is not None:
            self.dropped = _truncate_after(path, resume_step)
        self._file = open(path, "a", encoding="utf-8")
        if self._file.tell() > 0 and not _ends_with_newline(path):
            self._write_raw("\n")  # end a line torn by a killed run before appending after it
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
        return self._file is not None

    def _write_raw(self, text: str) -> None:
        self._file.write(text)
        self._file.flush()

    def _write(self, record: dict) -> None:
        self._write_raw(json.dumps(record) + "\n")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """One step's metrics; ``step`` is the optimizer step the metrics belong to."""
        if not self.active:
            return
        values = {k: _plain(v) for k, v in metrics.items() if k not in ("step", "time")}
        self._write({"step": int(step), "time": round(time.time(), 3), **values})
        if self._wandb_run is not None:
            self._wandb_run.log({"step": int(step), **_scalars(values)})

    def event(self, step: int, name: str, **fields: Any) -> None:
        """Something that happened once (``rollback``, ``precision_flip`` ...): a jsonl record, a wandb point
        ``event/<name> = 1`` at ``step``, and ``last_event/<name>`` in the wandb summary with its fields."""
        if not self.active:
            return
        fields = {k: _plain(v) for k, v in fields.items() if k not in ("step", "time", "event")}
        self._write({"step": int(step), "time": round(time.time(), 3), "event": name, **fields})
        if self._wandb_run is not None:
            self._wandb_run.log({"step": int(step), f"event/{name}": 1})
            self._wandb_run.summary[f"last_event/{name}"] = {"step": int(step), **fields}

    def close(self, exit_code: int = 0) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
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
    | mem 45.3 GiB | bf16``; metrics that are absent are left out."""
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
        parts.append(text)
    for key, show in _LOG_FIELDS:
        value = num(key)
        if value is not None:
            parts.append(show(value))
    if metrics.get("phase"):
        parts.append(str(metrics["phase"]) + (" (emulated)" if metrics.get("emulated_fp8") else ""))
    return " | ".join(parts)
