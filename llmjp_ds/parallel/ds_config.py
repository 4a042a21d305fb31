"""DeepSpeed's JSON for a run: the bundled (or the user's) file, with the values that must agree with the run
config filled in from it. The JSON stays DeepSpeed's: only batch, clipping, dtype and ZeRO-stage keys are set."""

from __future__ import annotations

import json
from pathlib import Path

from llmjp_ds.config import REPO_ROOT, RunConfig
from llmjp_ds.errors import fail
from llmjp_ds.parallel.layout import Layout


def ds_config_path(cfg: RunConfig) -> Path:
    if cfg.parallel.ds_config:
        return Path(cfg.parallel.ds_config)
    name = "pipeline.json" if cfg.parallel.pipeline_stages > 1 else f"zero{cfg.parallel.zero_stage}.json"
    return REPO_ROOT / "ds_configs" / name


def _read(cfg: RunConfig) -> tuple[Path, dict]:
    path = ds_config_path(cfg)
    if path.is_file():
        try:
            ds = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            fail(f"DeepSpeed config {path} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}): "
                 "fix the file, or leave parallel.ds_config unset for the bundled ds_configs/")
        if not isinstance(ds, dict):
            fail(f"DeepSpeed config {path} must hold a JSON object, not a {type(ds).__name__}: see ds_configs/")
        return path, ds
    if cfg.parallel.ds_config:
        fail(f"DeepSpeed config {path} does not exist: pass an existing file as parallel.ds_config")
    return path, {}


def build_ds_config(cfg: RunConfig, layout: Layout) -> dict:
    """DeepSpeed's JSON with the values that must agree with the run config filled in from it."""
    path, ds = _read(cfg)
    bf16 = cfg.precision.dtype == "bf16"
    ds["train_batch_size"] = cfg.train.global_batch_size
    ds["train_micro_batch_size_per_gpu"] = cfg.train.micro_batch_size
    ds["gradient_accumulation_steps"] = layout.gradient_accumulation_steps(cfg.train.global_batch_size,
                                                                           cfg.train.micro_batch_size)
    ds["gradient_clipping"] = cfg.optim.clip_grad
    ds["bf16"] = {**ds.get("bf16", {}), "enabled": bf16}
    ds.pop("fp16", None)
    ds["zero_optimization"] = {**ds.get("zero_optimization", {}), "stage": cfg.parallel.zero_stage}
    if cfg.parallel.pipeline_stages > 1 and bf16:
        ds["data_types"] = {**ds.get("data_types", {}), "grad_accum_dtype": "fp32"}
    if cfg.parallel.pipeline_stages > 1 and layout.tensor > 1:
        # DeepSpeed would send 1/TP of each activation and all-gather it over the TP slice, which assumes the
        # slice's ranks hold the same activation; under sequence parallelism each holds its own shard
        ds["pipeline"] = {**ds.get("pipeline", {}), "pipe_partitioned": False, "grad_partitioned": False}
    ds.setdefault("steps_per_print", 1 << 30)  # the trainer logs; DeepSpeed stays quiet
    ds.setdefault("wall_clock_breakdown", False)
    # DeepSpeed's throughput timer synchronises the GPU at every micro-batch's forward and step, which keeps the
    # host from queueing the next micro-batch while the GPU runs this one; the trainer measures throughput itself
    ds.setdefault("timers", {"throughput": {"enabled": False}})
    for key in ("optimizer", "scheduler"):
        if key in ds:
            fail(f"{path} has an {key!r} block: llmjp-ds passes its own AdamW and LR schedule; remove the block "
                 "and set optim.* in the run config")
    return ds
