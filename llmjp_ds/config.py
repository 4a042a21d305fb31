"""The run config: one typed tree of dataclasses, named presets, YAML/JSON files and ``--set key=value``.

Everything that must agree (batch arithmetic, pipeline vs ZeRO, sequence length vs the model) is checked by
:func:`validate` before any process group or GPU memory exists, so a mistake on a 512-GPU job costs seconds.
DeepSpeed's own JSON (``ds_configs/``) stays DeepSpeed's; :mod:`llmjp_ds.engine` fills its batch, clipping and
dtype keys from this config.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmjp_ds.errors import fail

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class ModelConfig:
    preset: str = "tiny"
    overrides: dict = field(default_factory=dict)  # ModelPreset fields, e.g. {"num_layers": 2}
    backend: str = "auto"  # auto | te | torch
    z_loss: float = 1e-4
    activation_checkpointing: bool = False
    fused_loss: bool = True  # on CUDA: the loss as one compiled kernel over bf16 logits (see model/loss.py)
    init_from_hf: str | None = None  # start from an HF Llama checkpoint (continued pretraining)


@dataclass
class DataConfig:
    # Megatron-style blend "w1 prefix1 w2 prefix2 ..." (or one prefix); empty = the bundled demo corpus
    blend: list = field(default_factory=list)
    tokenizer: str | None = None  # .model file or HF tokenizer dir; exported with the model
    seq_len: int | None = None  # default: the model's max_position_embeddings
    split: list = field(default_factory=lambda: [0.99, 0.01])  # train / valid, by documents
    seed: int = 1234
    cache_dir: str | None = None


@dataclass
class OptimConfig:
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 2000
    decay_steps: int | None = None  # default: train.steps
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # not on norm weights
    clip_grad: float = 1.0


@dataclass
class TrainConfig:
    steps: int = 1000
    global_batch_size: int = 1024
    micro_batch_size: int = 1
    seed: int = 42
    eval_interval: int = 0  # 0 = no validation
    eval_batches: int = 4
    max_nonfinite_steps: int = 5  # consecutive skipped steps before the run stops
    # fault drills (tests, rehearsals): report these steps' loss as NaN (only in FP8 phases if inject_only_fp8)
    inject_nan_steps: list = field(default_factory=list)
    inject_only_fp8: bool = True


@dataclass
class ParallelConfig:
    zero_stage: int = 1
    pipeline_stages: int = 1
    partition_method: str = "flops"  # or DeepSpeed's: type:DecoderLayerPipe | parameters | uniform
    fused_grad_accumulation: bool = True  # one-pass fp32 accumulation (engine.fuse_grad_accumulation)
    ds_config: str | None = None  # DeepSpeed JSON; default ds_configs/zero{stage}.json or pipeline.json


@dataclass
class PhaseConfig:
    """One precision phase, starting at ``start_step`` (or at ``start_tokens`` consumed, whichever is given)."""

    precision: str = "bf16"  # bf16 | fp8
    start_step: int = 0
    start_tokens: int | None = None
    recipe: str = "delayed"  # delayed | current | block
    fp8_format: str = "hybrid"  # hybrid | e4m3
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"  # max | most_recent
    margin: int = 0
    calibration_steps: int = 1  # delayed scaling: BF16 steps that record amax before the flip


@dataclass
class GuardConfig:
    enabled: bool = True
    window: int = 20  # running mean over this many steps before the flip
    factor: float = 1.5  # loss above factor x running mean ...
    patience: int = 3  # ... for this many consecutive steps -> roll back


@dataclass
class PrecisionConfig:
    dtype: str = "bf16"  # parameter / compute dtype outside FP8 GEMMs: bf16 | fp32
    phases: list = field(default_factory=lambda: [PhaseConfig()])
    bf16_first_layers: int = 0  # keep the first N decoder layers in BF16 during FP8 phases
    bf16_last_layers: int = 0  # ... and the last N
    fp8_lm_head: bool = False  # FP8 phases: the LM head's GEMMs in FP8 too (LLM-jp and Megatron-LM keep it BF16)
    emulate_fp8: bool = False  # allow emulated FP8 where TE FP8 cannot run (CPU, GPUs before sm89)
    log_amax: bool = False
    fp8_weight_cache: bool = True  # FP8 phases: cast each weight once per step, reused by its micro-batches
    guard: GuardConfig = field(default_factory=GuardConfig)


@dataclass
class LoggingConfig:
    wandb: str = "offline"  # online | offline | disabled
    project: str = "llmjp-ds"
    run_name: str | None = None
    interval: int = 1
    progress: bool = True


@dataclass
class CheckpointConfig:
    interval: int = 1000  # steps; 0 = only on signal and at the end
    keep_last: int = 3
    grace_seconds: float = 600.0  # SIGTERM: time allowed for the final save
    save_at_end: bool = True  # false for throughput experiments that need no final checkpoint


@dataclass
class RunConfig:
    run_dir: str = "runs/default"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# --- presets ----------------------------------------------------------------------------------------------

def _preset_demo() -> dict:
    return {
        "run_dir": "runs/demo",
        "model": {"preset": "tiny", "backend": "auto"},
        "data": {"seq_len": 128},
        "optim": {"lr": 3e-3, "warmup_steps": 20, "min_lr_ratio": 0.1, "weight_decay": 0.1},
        "train": {"steps": 200, "global_batch_size": 8, "micro_batch_size": 8, "eval_interval": 50},
        "parallel": {"zero_stage": 1},
        "precision": {"dtype": "fp32"},
        "checkpoint": {"interval": 50, "keep_last": 2},
    }


def _preset_llmjp3(size: str, lr: float, gbs: int) -> dict:
    return {
        "run_dir": f"runs/llmjp3-{size}",
        "model": {"preset": f"llmjp3-{size}", "z_loss": 1e-4},
        "optim": {"lr": lr, "min_lr_ratio": 0.1, "warmup_steps": 2000, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
                  "weight_decay": 0.1, "clip_grad": 1.0},
        "train": {"global_batch_size": gbs, "micro_batch_size": 1, "steps": 2_100_000_000_000 // (gbs * 4096)},
        "parallel": {"zero_stage": 1},
        "precision": {"dtype": "bf16"},
    }


def _preset_172b() -> dict:
    cfg = _preset_llmjp3("172b", 1e-4, 1728)
    # 64 x 8 H100 without tensor parallelism: PP32 x DP16, ZeRO-1, full activation recompute; PP16 does not fit
    # 80 GB (docs/172b-layout.md)
    cfg["parallel"] = {"zero_stage": 1, "pipeline_stages": 32}
    cfg["model"]["activation_checkpointing"] = True
    # LLM-jp exp1: BF16, then FP8 hybrid delayed scaling from iteration 7000
    cfg["precision"]["phases"] = [{"precision": "bf16"},
                                  {"precision": "fp8", "start_step": 7000, "recipe": "delayed",
                                   "fp8_format": "hybrid", "amax_history_len": 1, "amax_compute_algo": "most_recent"}]
    return cfg


RUN_PRESETS: dict[str, typing.Callable[[], dict]] = {
    "demo": _preset_demo,
    "llmjp3-1.8b": lambda: _preset_llmjp3("1.8b", 3e-4, 512),
    "llmjp3-3.7b": lambda: _preset_llmjp3("3.7b", 3e-4, 1024),
    "llmjp3-13b": lambda: _preset_llmjp3("13b", 2e-4, 1024),
    "llmjp3-172b": _preset_172b,
}


# --- building a config from dicts -----------------------------------------------------------------------

def _did_you_mean(name: str, options) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _type_ok(value: Any, annotation) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return any(_type_ok(value, a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation in (list, dict, str, bool):
        return isinstance(value, annotation)
    return True


def _type_name(annotation) -> str:
    return str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")


def build(cls, data: dict, path: str = ""):
    """Instantiate dataclass ``cls`` from a nested dict, rejecting unknown keys and wrong types."""
    if not isinstance(data, dict):
        fail(f"config section {path or '<root>'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else key
        if key not in names:
            fail(f"unknown config key {where!r}{_did_you_mean(key, names)}")
        annotation = hints[key]
        if dataclasses.is_dataclass(annotation):
            value = build(annotation, value, where)
        elif key == "phases":
            if not isinstance(value, list) or not value:
                fail(f"{where} must be a non-empty list of phases")
            value = [build(PhaseConfig, v, f"{where}[{i}]") for i, v in enumerate(value)]
        elif not _type_ok(value, annotation):
            fail(f"config key {where!r} must be {_type_name(annotation)}, got {value!r}")
        kwargs[key] = value
    return cls(**kwargs)


def merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_value(text: str) -> Any:
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", value):
        return float(value)  # YAML 1.1 reads 1e-4 (no dot in the mantissa) as a string
    return value


def apply_set(data: dict, assignment: str) -> dict:
    """``a.b.c=value`` -> nested dict update (value parsed as YAML: numbers, bools, lists, null)."""
    if "=" not in assignment:
        fail(f"--set {assignment!r} must look like key=value, e.g. optim.lr=1e-4")
    key, _, raw = assignment.partition("=")
    update: dict = {}
    node = update
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = parse_value(raw)
    return merge(data, update)


def load_file(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        fail(f"config file {path} does not exist: pass the path of a YAML or JSON run config (or use --preset)")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        fail(f"cannot read config file {path} ({exc}): pass a UTF-8 YAML or JSON file")
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text) or {}
    except Exception as exc:  # yaml / json syntax errors
        mark = getattr(exc, "problem_mark", None)  # yaml: where; json: msg + lineno/colno
        if mark is not None:
            where = f"{getattr(exc, 'problem', None) or str(exc).splitlines()[0]} at line {mark.line + 1}, column " \
                    f"{mark.column + 1}"
        elif isinstance(exc, json.JSONDecodeError):
            where = f"{exc.msg} at line {exc.lineno}, column {exc.colno}"
        else:
            where = str(exc).splitlines()[0]
        fail(f"cannot parse config file {path}: {where}; fix the syntax there")
    if not isinstance(data, dict):
        fail(f"config file {path} holds a {type(data).__name__}, not a mapping of sections (run_dir, model, data, "
             "optim, train, ...): see the presets in llmjp_ds/config.py")
    return data


def load_config(path: str | Path | None = None, sets: list[str] = (), preset: str | None = None) -> RunConfig:
    """Preset (from ``preset``, the file's ``preset:`` key, or ``demo``) <- file <- ``--set`` overrides."""
    data = load_file(path) if path else {}
    name = preset or data.pop("preset", None) or "demo"
    if name not in RUN_PRESETS:
        fail(f"unknown run preset {name!r}{_did_you_mean(name, RUN_PRESETS)}: choose one of {', '.join(RUN_PRESETS)}")
    data = merge(RUN_PRESETS[name](), data)
    for assignment in sets:
        data = apply_set(data, assignment)
    return build(RunConfig, data)


# --- validation -----------------------------------------------------------------------------------------

def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def data_parallel_size(cfg: RunConfig, world_size: int) -> int:
    return world_size // cfg.parallel.pipeline_stages


def gradient_accumulation_steps(cfg: RunConfig, world_size: int) -> int:
    return cfg.train.global_batch_size // (cfg.train.micro_batch_size * data_parallel_size(cfg, world_size))


def sample_counts(cfg: RunConfig) -> tuple[int, int]:
    """(train, valid) samples the run reads; no validation split is needed when ``eval_interval`` is 0."""
    t = cfg.train
    return t.steps * t.global_batch_size, (max(1, t.eval_batches) * t.global_batch_size if t.eval_interval else 0)


def validate(cfg: RunConfig, world_size: int | None = None) -> None:
    """Checks that need no process group and no GPU. Raises UserError with the fix."""
    from llmjp_ds.model.backend import BACKENDS
    from llmjp_ds.model.presets import get_preset

    world_size = world_size or world_size_from_env()
    t, p, o = cfg.train, cfg.parallel, cfg.optim
    preset = get_preset(cfg.model.preset)
    shape_fields = typing.get_type_hints(type(preset))
    for key, value in cfg.model.overrides.items():
        if key not in shape_fields:
            fail(f"unknown model.overrides key {key!r}{_did_you_mean(key, shape_fields)}: valid keys are "
                 f"{', '.join(shape_fields)}")
        if not _type_ok(value, shape_fields[key]) or value <= 0:
            fail(f"model.overrides.{key} must be a positive {_type_name(shape_fields[key])}, got {value!r}")
    if cfg.model.backend not in BACKENDS:
        fail(f"model.backend {cfg.model.backend!r} is not one of {', '.join(BACKENDS)}")
    for name in ("steps", "global_batch_size", "micro_batch_size"):
        if getattr(t, name) <= 0:
            fail(f"train.{name} must be positive, got {getattr(t, name)}")
    if p.zero_stage not in (0, 1, 2, 3):
        fail(f"parallel.zero_stage must be 0, 1, 2 or 3, got {p.zero_stage}")
    if p.pipeline_stages < 1:
        fail(f"parallel.pipeline_stages must be >= 1, got {p.pipeline_stages}")
    if p.pipeline_stages > 1 and p.zero_stage > 1:
        fail(f"ZeRO-{p.zero_stage} cannot be combined with pipeline parallelism (DeepSpeed shards gradients "
             "across micro-batches): use parallel.zero_stage=1 with pipeline_stages > 1")
    method = p.partition_method.lower()
    if method not in ("flops", "parameters", "uniform") and not (method.startswith("type:") and method[5:]):
        fail(f"unknown parallel.partition_method {p.partition_method!r}: use flops, parameters, uniform or "
             "type:<layer class regex>")
    num_layers = cfg.model.overrides.get("num_layers", preset.num_layers)
    if p.pipeline_stages > num_layers:
        fail(f"parallel.pipeline_stages={p.pipeline_stages} exceeds the model's {num_layers} layers: use at most "
             f"{num_layers} stages")
    if world_size % p.pipeline_stages:
        fail(f"world size {world_size} is not divisible by parallel.pipeline_stages={p.pipeline_stages}: launch a "
             f"multiple of {p.pipeline_stages} ranks (nodes x GPUs), or change parallel.pipeline_stages")
    dp = data_parallel_size(cfg, world_size)
    if t.global_batch_size % (t.micro_batch_size * dp):
        fail(f"train.global_batch_size={t.global_batch_size} is not divisible by micro_batch_size x data parallel "
             f"= {t.micro_batch_size} x {dp}: make it a multiple of {t.micro_batch_size * dp}")
    max_pos = cfg.model.overrides.get("seq_len", preset.seq_len)
    if cfg.data.seq_len is not None and cfg.data.seq_len > max_pos:
        fail(f"data.seq_len={cfg.data.seq_len} exceeds the model's max_position_embeddings {max_pos}: lower it or "
             "set model.overrides.seq_len")
    if not 0 <= o.min_lr_ratio <= 1 or o.lr <= 0:
        fail(f"optim.lr must be > 0 and optim.min_lr_ratio in [0, 1], got lr={o.lr}, min_lr_ratio={o.min_lr_ratio}")
    if o.warmup_steps < 0:
        fail(f"optim.warmup_steps must be >= 0, got {o.warmup_steps}")
    if len(cfg.data.split) != 2 or any(x < 0 for x in cfg.data.split) or cfg.data.split[0] <= 0:
        fail(f"data.split must be [train, valid] fractions, got {cfg.data.split}")
    if cfg.logging.wandb not in ("online", "offline", "disabled"):
        fail(f"logging.wandb must be online, offline or disabled, got {cfg.logging.wandb!r}"
             f"{_did_you_mean(cfg.logging.wandb, ('online', 'offline', 'disabled'))}")
    if cfg.logging.interval < 1:
        fail(f"logging.interval must be >= 1 (log every N steps), got {cfg.logging.interval}")
    if cfg.checkpoint.interval < 0 or t.eval_interval < 0:
        fail(f"checkpoint.interval and train.eval_interval must be >= 0 (0 = off), got {cfg.checkpoint.interval} "
             f"and {t.eval_interval}")
    if not cfg.checkpoint.grace_seconds > 0:
        fail(f"checkpoint.grace_seconds must be > 0 (time allowed for the save after SIGTERM), got "
             f"{cfg.checkpoint.grace_seconds}")
    if t.max_nonfinite_steps < 1:
        fail(f"train.max_nonfinite_steps must be >= 1 (consecutive skipped steps before the run stops), got "
             f"{t.max_nonfinite_steps}")
    if cfg.precision.dtype not in ("bf16", "fp32"):
        fail(f"precision.dtype must be bf16 or fp32, got {cfg.precision.dtype!r}")
    if cfg.checkpoint.keep_last < 1:
        fail(f"checkpoint.keep_last must be >= 1, got {cfg.checkpoint.keep_last}")
    from llmjp_ds.precision import validate_phases

    validate_phases(cfg.precision, num_layers)
    from llmjp_ds.engine import build_ds_config

    build_ds_config(cfg, world_size)  # the DeepSpeed JSON: exists, parses, has no optimizer/scheduler block
