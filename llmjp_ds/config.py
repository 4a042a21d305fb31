"""The run config: one typed tree of dataclasses, named run presets, YAML/JSON files and ``--set key=value``.

A run preset (:data:`RUN_PRESETS`) is a whole :class:`RunConfig`; its ``model.shape`` names a model shape of
:mod:`llmjp_ds.model.shapes`. A file and ``--set`` overrides are merged over the preset and the result is built
by one typed loader (:func:`build`) that rejects unknown keys and wrong types by the dataclasses' annotations.
Everything that must agree across sections is checked by :func:`llmjp_ds.validate.validate_run` before any
process group or GPU memory exists. DeepSpeed's own JSON (``ds_configs/``) stays DeepSpeed's;
:mod:`llmjp_ds.parallel.ds_config` fills its batch, clipping and dtype keys from this config.
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from llmjp_ds.errors import did_you_mean, fail
from llmjp_ds.model.shapes import ShapeOverrides, overrides_dict

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class ModelConfig:
    shape: str = "tiny"  # a name in llmjp_ds.model.shapes.MODEL_SHAPES
    overrides: ShapeOverrides = field(default_factory=ShapeOverrides)  # e.g. {num_layers: 2}
    backend: str = "auto"  # auto | te | torch
    z_loss: float = 1e-4
    # activation recompute: none | selective (the attention core, as LLM-jp's 172B run) | full (every decoder layer)
    recompute: str = "none"
    fused_loss: bool = True  # on CUDA: the loss as one compiled kernel over bf16 logits (see model/loss.py)
    init_from_hf: str | None = None  # start from an HF Llama checkpoint (continued pretraining)


@dataclass
class DataConfig:
    # Megatron-style blend "w1 prefix1 w2 prefix2 ..." (or one prefix); empty = the bundled demo corpus
    blend: list[float | str] = field(default_factory=list)
    tokenizer: str | None = None  # .model file or HF tokenizer dir; exported with the model
    seq_len: int | None = None  # default: the model's max_position_embeddings
    split: list[float] = field(default_factory=lambda: [0.99, 0.01])  # train / valid, by documents
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


@dataclass
class ParallelConfig:
    zero_stage: int = 1
    pipeline_stages: int = 1
    tensor_parallel: int = 1  # TE's tensor parallelism inside each layer; its ranks are adjacent (one node)
    sequence_parallel: bool | None = None  # default: on when tensor_parallel > 1
    partition_method: str = "flops"  # or DeepSpeed's: type:DecoderLayerPipe | parameters | uniform
    fused_grad_accumulation: bool = True  # one-pass fp32 accumulation (parallel.deepspeed_internals)
    ds_config: str | None = None  # DeepSpeed JSON; default ds_configs/zero{stage}.json or pipeline.json
    # a rank that makes no progress in a step phase for this long ends the job (parallel/failure.py); longer than
    # any phase of a 172B step, including a checkpoint save of its ~2.6 TB of state
    stall_timeout_s: float = 1200.0


@dataclass
class PhaseConfig:
    """One precision phase, starting at ``start_step`` (or at ``start_tokens`` consumed, whichever is given)."""

    precision: str = "bf16"  # bf16 | fp8
    start_step: int = 0
    start_tokens: int | None = None
    recipe: str = "delayed"  # delayed | current | block | auto (chosen at the flip by measured penalty)
    candidates: list[str] = field(default_factory=lambda: ["delayed", "current", "block"])  # for recipe: auto
    fallback: list[str] = field(default_factory=list)  # e.g. [current, block, bf16]: guard.penalty_action=fallback
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
    # FP8's loss penalty, valid_loss / valid_loss_bf16 - 1, measured at every validation in an FP8 phase
    max_penalty: float = 0.02  # above this for penalty_patience validations in a row -> penalty_action
    penalty_patience: int = 2
    penalty_action: str = "warn"  # warn | fallback (the phase's fallback chain) | bf16


@dataclass
class PrecisionConfig:
    dtype: str = "bf16"  # parameter / compute dtype outside FP8 GEMMs: bf16 | fp32
    phases: list[PhaseConfig] = field(default_factory=lambda: [PhaseConfig()])
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


# --- run presets ------------------------------------------------------------------------------------------

def _preset_demo() -> RunConfig:
    return RunConfig(
        run_dir="runs/demo",
        model=ModelConfig(shape="tiny", backend="auto"),
        data=DataConfig(seq_len=128),
        optim=OptimConfig(lr=3e-3, warmup_steps=20, min_lr_ratio=0.1, weight_decay=0.1),
        train=TrainConfig(steps=200, global_batch_size=8, micro_batch_size=8, eval_interval=50),
        parallel=ParallelConfig(zero_stage=1),
        precision=PrecisionConfig(dtype="fp32"),
        checkpoint=CheckpointConfig(interval=50, keep_last=2))


def _preset_llmjp3(size: str, lr: float, gbs: int) -> RunConfig:
    """LLM-jp-3's recipe: AdamW (0.9, 0.95, 1e-8), weight decay 0.1, clip 1.0, 2000 warm-up steps, cosine to
    lr / 10, z-loss 1e-4, seq 4096, 2.1T tokens."""
    return RunConfig(
        run_dir=f"runs/llmjp3-{size}",
        model=ModelConfig(shape=f"llmjp3-{size}", z_loss=1e-4),
        optim=OptimConfig(lr=lr, min_lr_ratio=0.1, warmup_steps=2000, beta1=0.9, beta2=0.95, eps=1e-8,
                          weight_decay=0.1, clip_grad=1.0),
        train=TrainConfig(global_batch_size=gbs, micro_batch_size=1, steps=2_100_000_000_000 // (gbs * 4096)),
        parallel=ParallelConfig(zero_stage=1),
        precision=PrecisionConfig(dtype="bf16"))


def _preset_172b() -> RunConfig:
    cfg = _preset_llmjp3("172b", 1e-4, 1728)
    # 64 x 8 H100 as LLM-jp's Megatron run: TP4 (sequence parallel) x PP16 x DP8, ZeRO-1, selective recompute;
    # the fastest layout that fits 80 GB (docs/172b-layout.md)
    cfg.parallel = ParallelConfig(zero_stage=1, pipeline_stages=16, tensor_parallel=4)
    cfg.model.recompute = "selective"
    # LLM-jp exp1: BF16, then FP8 hybrid delayed scaling from iteration 7000
    cfg.precision.phases = [PhaseConfig(precision="bf16"),
                            PhaseConfig(precision="fp8", start_step=7000, recipe="delayed", fp8_format="hybrid",
                                        amax_history_len=1, amax_compute_algo="most_recent")]
    return cfg


RUN_PRESETS: dict[str, Callable[[], RunConfig]] = {
    "demo": _preset_demo,
    "llmjp3-1.8b": lambda: _preset_llmjp3("1.8b", 3e-4, 512),
    "llmjp3-3.7b": lambda: _preset_llmjp3("3.7b", 3e-4, 1024),
    "llmjp3-13b": lambda: _preset_llmjp3("13b", 2e-4, 1024),
    "llmjp3-172b": _preset_172b,
}


def preset_dict(name: str) -> dict:
    """The run preset ``name`` as a plain dict (the base that files and ``--set`` are merged over)."""
    if name not in RUN_PRESETS:
        fail(f"unknown run preset {name!r}{did_you_mean(name, RUN_PRESETS)}: choose one of {', '.join(RUN_PRESETS)}")
    data = RUN_PRESETS[name]().to_dict()
    data["model"]["overrides"] = overrides_dict(data["model"]["overrides"])
    return data


# --- building a config from dicts -----------------------------------------------------------------------

# keys of earlier releases -> their names now
RENAMED = {"model.preset": "model.shape", "train.inject_nan_steps": None, "train.inject_only_fp8": None,
           "model.activation_checkpointing": "model.recompute"}


def _type_ok(value: Any, annotation) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(annotation))
    if origin is list:
        (item,) = typing.get_args(annotation)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
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
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "null"
    return str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")


def _renamed(where: str) -> None:
    if where in RENAMED:
        now = RENAMED[where]
        if where == "model.activation_checkpointing":
            fail("config key 'model.activation_checkpointing' was replaced by 'model.recompute': use "
                 "model.recompute=full (was true), none (was false) or selective (the attention core only)")
        fail(f"config key {where!r} was renamed {now!r}: use {now}" if now else
             f"config key {where!r} was removed (fault drills are set by LLMJP_DS_DRILL_*, see docs/errors.md)")


def _build_value(value: Any, annotation, where: str):
    """``value`` as ``annotation``: a dataclass from a mapping, a list of dataclasses from a list of mappings."""
    if dataclasses.is_dataclass(annotation):
        return build(annotation, value, where)
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        if dataclasses.is_dataclass(item):
            if not isinstance(value, list) or not value:
                fail(f"{where} must be a non-empty list of {item.__name__} mappings")
            return [build(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if not _type_ok(value, annotation):
        fail(f"config key {where!r} must be {_type_name(annotation)}, got {value!r}")
    return value


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
            _renamed(where)
            fail(f"unknown config key {where!r}{did_you_mean(key, names)}")
        kwargs[key] = _build_value(value, hints[key], where)
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
    data = merge(preset_dict(name), data)
    for assignment in sets:
        data = apply_set(data, assignment)
    return build(RunConfig, data)


# --- quantities derived from the config -----------------------------------------------------------------

def sample_counts(cfg: RunConfig) -> tuple[int, int]:
    """(train, valid) samples the run reads; no validation split is needed when ``eval_interval`` is 0."""
    t = cfg.train
    return t.steps * t.global_batch_size, (max(1, t.eval_batches) * t.global_batch_size if t.eval_interval else 0)


def model_config_of(cfg: RunConfig):
    """The transformers ``LlamaConfig`` of the run's model shape with its overrides."""
    from llmjp_ds.model.shapes import model_config, overrides_dict

    return model_config(cfg.model.shape, **overrides_dict(cfg.model.overrides))


def seq_len_of(cfg: RunConfig, model_config) -> int:
    return cfg.data.seq_len or model_config.max_position_embeddings


RECOMPUTE_MODES = ("none", "selective", "full")


def sequence_parallel_of(cfg: RunConfig) -> bool:
    """Sequence parallelism is on with tensor parallelism unless the config turns it off (and off without it)."""
    sp = cfg.parallel.sequence_parallel
    return cfg.parallel.tensor_parallel > 1 and (sp is None or sp)
