"""The run config: one typed tree of dataclasses, named run presets, YAML/JSON files and ``--set key=value``.

A run preset (:data:`RUN_PRESETS`) is a whole :class:`RunConfig`; its ``model.shape`` names a model shape of
:mod:`llmjp_ds.model.shapes`. A file and ``--set`` overrides are merged over the preset and the result is built
by one typed loader (:func:`build`) that rejects unknown keys and wrong types by the dataclasses' annotations.
Every numeric field declares its valid range (:class:`Valid`) and every path field what it must be
(:class:`PathRule`) in its field metadata; :mod:`llmjp_ds.validate` checks them all by one walk of the tree.
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

from llmjp_ds.errors import UserError, did_you_mean, fail
from llmjp_ds.model.shapes import ShapeOverrides, overrides_dict

REPO_ROOT = Path(__file__).resolve().parents[1]


# --- what a field may hold: declared beside it (field metadata), checked by validate.check_values --------

@dataclass(frozen=True)
class Valid:
    """The values a numeric field (or each number of a list field) may take; NaN and infinity never.

    The message reads ``<key> must be <rule> (<why>), got <value>``; ``says`` words the rule where bounds read
    worse ("positive"; ``{type}`` is the field's type), ``message`` (``str.format`` of ``where``, ``value`` and
    ``section``) replaces it where one check covers two fields. On a field holding a dataclass it is the rule of
    every field of that dataclass that declares none (``model.overrides``: the fields of a model shape)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # lo itself excluded
    hi_open: bool = False
    choices: tuple = ()
    why: str = ""
    says: str = ""
    message: str = ""

    def admits(self, value) -> bool:
        if self.choices:
            return value in self.choices
        return ((self.lo is None or (value > self.lo if self.lo_open else value >= self.lo)) and
                (self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)))

    def text(self) -> str:
        if self.says:
            return self.says
        if self.choices:
            return ", ".join(map(str, self.choices[:-1])) + f" or {self.choices[-1]}"
        if self.lo is not None and self.hi is not None:
            return f"in {'(' if self.lo_open else '['}{self.lo}, {self.hi}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {self.lo}"
        if self.hi is not None:
            return f"{'<' if self.hi_open else '<='} {self.hi}"
        return "a finite number"


def at_least(lo, why: str = "", **kw) -> dict:
    return {"valid": Valid(lo=lo, why=why, **kw)}


def above(lo, why: str = "", **kw) -> dict:
    return {"valid": Valid(lo=lo, lo_open=True, why=why, **kw)}


def within(lo, hi, why: str = "", **kw) -> dict:
    return {"valid": Valid(lo=lo, hi=hi, why=why, **kw)}


def one_of(*choices, why: str = "") -> dict:
    return {"valid": Valid(choices=choices, why=why)}


@dataclass(frozen=True)
class PathRule:
    """A path field. ``input``: must exist (an input directory must hold ``inside``), else ``fix``; ``output``:
    it, or its nearest existing parent, must be a writable directory; ``own``: the run's own directory (not /, the
    home, the repository or the current directory, nor one that holds them)."""

    kind: str  # input | output
    fix: str = ""
    inside: str = ""
    own: bool = False


def input_path(fix: str, inside: str = "") -> dict:
    return {"path": PathRule("input", fix, inside)}


def output_path(own: bool = False) -> dict:
    return {"path": PathRule("output", own=own)}


# one check of both fields, worded as before the field rules
LR_MESSAGE = ("optim.lr must be > 0 and optim.min_lr_ratio in [0, 1], got lr={section.lr}, "
              "min_lr_ratio={section.min_lr_ratio}")

PENALTY_MESSAGE = ("precision.guard.max_penalty must be > 0 and penalty_patience >= 1, got {section.max_penalty} "
                   "and {section.penalty_patience}")
SEED = within(0, 2**32 - 1, why="numpy seeds are 32-bit")


@dataclass
class ModelConfig:
    shape: str = "tiny"  # a name in llmjp_ds.model.shapes.MODEL_SHAPES
    # e.g. {num_layers: 2}; every field of a shape is a positive number
    overrides: ShapeOverrides = field(default_factory=ShapeOverrides, metadata=above(0, says="a positive {type}"))
    backend: str = "auto"  # auto | te | torch
    z_loss: float = field(default=1e-4, metadata=at_least(0, "the z-loss coefficient; 0 = off"))
    # activation recompute: none | selective (the attention core, as LLM-jp's 172B run) | full (every decoder layer)
    recompute: str = "none"
    # on CUDA: the loss over bf16 logits as two Triton kernels, or one compiled kernel (model/loss.py)
    fused_loss: bool = True
    # TE backend: the QKV split and both RoPE rotations as one fused kernel (model/te_layers.split_qkv_rope): triton
    # = ours, rotating Q and K in place in the QKV output (model/kernels/rope.py), true or te = TE's, false = none
    fused_qkv_rope: bool | str = "triton"
    # TE backend: the causal attention core of training and evaluation. te = TE's DotProductAttention; cudnn =
    # torch's scaled_dot_product_attention on its cuDNN backend: the same cuDNN kernels for a third of the host's
    # time per call, but the Q, K, V gradients come back as three tensors, which RoPE's backward then packs (one
    # more pass over V's). For steps whose profile shows the GPU waiting on the attention's host work
    attention_core: str = "te"
    # TE backend: each residual's gradient is added inside the backward of the norm that reads the residual (TE's
    # rmsnorm_bwd_add), not by autograd in a kernel of its own (model/residual_grad.py). Off under recompute: full
    fused_residual_norm: bool = True
    # start from an HF Llama checkpoint (continued pretraining)
    init_from_hf: str | None = field(default=None, metadata=input_path(
        "pass the directory save_pretrained wrote (config.json and safetensors)", inside="config.json"))

    def __post_init__(self):
        for key, choices in KERNEL_CHOICES.items():
            value = getattr(self, key)
            if not any(type(value) is type(c) and value == c for c in choices):
                names = ", ".join(str(c).lower() if isinstance(c, bool) else c for c in choices)
                fail(f"model.{key} must be one of {names}, got {value!r}"
                     f"{did_you_mean(str(value), [str(c) for c in choices])}")


# the model fields that choose a kernel, and what each may be
KERNEL_CHOICES = {"fused_qkv_rope": (True, False, "te", "triton"), "attention_core": ("te", "cudnn")}


DATA_ORDERS = ("llmjp", "megatron")
PHASE_COUNTS = ("run", "phase")


@dataclass
class DataPhase:
    """From ``start_step`` on, the run reads ``blend``. ``count: run``: the new blend's samples at the run's
    consumed-sample count, sized to the whole run (Megatron-LM restarted with another --data-path); ``phase``: from
    the new blend's first sample, sized to the phase (Megatron-LM's --phase-transition-iterations)."""

    start_step: int = field(default=1, metadata=at_least(1, "the first step of the phase; step 0 is data.blend's"))
    blend: list[float | str] = field(default_factory=list, metadata=at_least(0, "a corpus weight"))
    count: str = field(default="run", metadata=one_of(*PHASE_COUNTS, why="where the new blend's samples start"))


@dataclass
class DataConfig:
    # Megatron-style blend "w1 prefix1 w2 prefix2 ..." (or one prefix); empty = the bundled demo corpus
    blend: list[float | str] = field(default_factory=list, metadata=at_least(0, "a corpus weight"))
    # .model file or HF tokenizer dir; exported with the model
    tokenizer: str | None = field(default=None, metadata=input_path(
        "pass a SentencePiece .model or an HF tokenizer dir"))
    seq_len: int | None = field(default=None, metadata=at_least(1))  # default: the model's max_position_embeddings
    split: list[float] = field(default_factory=lambda: [0.99, 0.01],  # train / valid [/ test] shares of documents
                               metadata=at_least(0, "a share of the documents"))
    seed: int = field(default=1234, metadata=SEED)  # Megatron-LM's --seed under order: megatron
    cache_dir: str | None = field(default=None, metadata=output_path())
    # which samples, in which order: llmjp (data/dataset.py: per-epoch shuffles, divisor blend, prefix-stable) or
    # megatron (megatron-core's BlendedMegatronDatasetBuilder + GPTDataset, as Megatron-LM's pretrain_gpt.py: the
    # same blend, seq_len, seed, split and run length give Megatron's windows; needs llmjp-ds[megatron])
    order: str = field(default="llmjp", metadata=one_of(*DATA_ORDERS, why="the sample order"))
    # the blend changes at given steps (a decay branch with another mix, a mid-training phase): data/phases.py
    phases: list[DataPhase] = field(default_factory=list)


@dataclass
class OptimConfig:
    lr: float = field(default=3e-4, metadata=above(0, message=LR_MESSAGE))
    # the decay ends at lr * min_lr_ratio (Megatron-LM's --min-lr = lr * min_lr_ratio)
    min_lr_ratio: float = field(default=0.1, metadata=within(0, 1, message=LR_MESSAGE))
    warmup_steps: int = field(default=2000, metadata=at_least(0))  # --lr-warmup-iters
    decay_steps: int | None = field(default=None, metadata=at_least(1))  # --lr-decay-iters; default: train.steps
    # the warmup's formula: llmjp = lr * (step + 1) / warmup (the first step already learns); megatron = Megatron-LM's
    # OptimizerParamScheduler, lr * step / warmup (its first step at LR 0): a run that continues a Megatron run
    # (import-megatron) keeps its schedule
    schedule: str = "llmjp"
    # the decay after the warmup (--lr-decay-style): constant | linear | cosine | inverse-square-root | WSD (warmup,
    # stable at lr, then a decay of wsd_decay_steps that ends at decay_steps)
    decay_style: str = "cosine"
    # WSD's decay: its shape (--lr-wsd-decay-style: exponential | linear | cosine | minus_sqrt) and its length in
    # steps (--lr-wsd-decay-iters)
    wsd_decay_style: str = "exponential"
    wsd_decay_steps: int | None = field(default=None, metadata=at_least(1))
    warmup_init_lr: float = field(default=0.0, metadata=at_least(0))  # the warmup's first LR (--lr-warmup-init)
    beta1: float = field(default=0.9, metadata=within(0, 1, "AdamW's moment decay", hi_open=True))
    beta2: float = field(default=0.95, metadata=within(0, 1, "AdamW's moment decay", hi_open=True))
    eps: float = field(default=1e-8, metadata=above(0, "AdamW's denominator term"))
    weight_decay: float = field(default=0.1, metadata=at_least(0))  # not on norm weights; --start-weight-decay
    # the weight decay at train.steps (--end-weight-decay), reached by weight_decay_incr_style (constant | linear |
    # cosine, --weight-decay-incr-style); None: constant at weight_decay
    end_weight_decay: float | None = field(default=None, metadata=at_least(0))
    weight_decay_incr_style: str = "constant"
    clip_grad: float = field(default=1.0, metadata=at_least(0, "the gradient-norm clip; 0 = off"))
    # on CUDA with DeepSpeed's BF16 optimizer: the clip, AdamW and the bf16 copy of the weights in one Triton
    # pass (llmjp_ds.model.kernels.adamw); elsewhere, and when false, DeepSpeed's step
    fused_step: bool = True
    # a resumed checkpoint's schedule (Megatron's opt_param_scheduler) against this one: check = every value must
    # agree (Megatron's default); override = this config's schedule from here on (--override-opt_param-scheduler);
    # checkpoint = the checkpoint's (--use-checkpoint-opt_param-scheduler)
    resume_schedule: str = "check"

    def __post_init__(self):
        for key, choices in OPTIM_CHOICES.items():
            value = getattr(self, key)
            if value not in choices:
                fail(f"optim.{key} must be one of {', '.join(choices)}, got {value!r}"
                     f"{did_you_mean(str(value), choices)}")


LR_SCHEDULES = ("llmjp", "megatron")  # optim.schedule: the conventions of llmjp_ds.lr_schedule.LRSchedule
# megatron-core's OptimizerParamScheduler's styles, by its names
DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
WEIGHT_DECAY_INCR_STYLES = ("constant", "linear", "cosine")
RESUME_SCHEDULES = ("check", "override", "checkpoint")
# the optim fields that name a choice, and what each may be
OPTIM_CHOICES = {"schedule": LR_SCHEDULES, "decay_style": DECAY_STYLES, "wsd_decay_style": WSD_DECAY_STYLES,
                 "weight_decay_incr_style": WEIGHT_DECAY_INCR_STYLES, "resume_schedule": RESUME_SCHEDULES}


@dataclass
class BatchChange:
    """From ``start_step`` on, the global batch is ``global_batch_size`` (a step 0 change sets the first batch)."""

    start_step: int = field(default=0, metadata=at_least(0))
    global_batch_size: int = field(default=1, metadata=at_least(1, says="positive"))


@dataclass
class TrainConfig:
    steps: int = field(default=1000, metadata=at_least(1, says="positive"))
    # Megatron-LM's --global-batch-size: the batch after any ramp and before any change, and the unit that turns the
    # LR schedule's step counts into samples (Megatron's scheduler counts samples)
    global_batch_size: int = field(default=1024, metadata=at_least(1, says="positive"))
    # Megatron-LM's --rampup-batch-size START INCREMENT SAMPLES: from START up to global_batch_size in steps of
    # INCREMENT over the first SAMPLES consumed samples (batching.BatchSchedule)
    batch_rampup: list[int] | None = field(default=None, metadata=at_least(1, says="positive"))
    # step changes of the global batch, e.g. [{start_step: 1000000, global_batch_size: 2048}]: a run restarted there
    # with another --global-batch-size, or Megatron-Core 0.19's --step-batch-size-schedule
    batch_changes: list[BatchChange] = field(default_factory=list)
    micro_batch_size: int = field(default=1, metadata=at_least(1, says="positive"))
    # ranges [first, end) of step indices whose samples are read and not trained on, the LR schedule not advancing
    # over them: Megatron-LM's --iterations-to-skip (its iteration N is step N - 1); a rollback adds its own
    skip_steps: list[list[int]] = field(default_factory=list, metadata=at_least(0, "a step index"))
    seed: int = field(default=42, metadata=SEED)
    eval_interval: int = field(default=0, metadata=at_least(0, "0 = no validation"))
    eval_batches: int = field(default=4, metadata=at_least(0))
    max_nonfinite_steps: int = field(default=5, metadata=at_least(
        1, "consecutive skipped steps before the run stops"))


@dataclass
class ParallelConfig:
    zero_stage: int = field(default=1, metadata=one_of(0, 1, 2, 3))
    pipeline_stages: int = field(default=1, metadata=at_least(1))
    # TE's tensor parallelism inside each layer; its ranks are adjacent (one node)
    tensor_parallel: int = field(default=1, metadata=at_least(1))
    sequence_parallel: bool | None = None  # default: on when tensor_parallel > 1
    partition_method: str = "flops"  # or DeepSpeed's: type:DecoderLayerPipe | parameters | uniform
    fused_grad_accumulation: bool = True  # one-pass fp32 accumulation (parallel.deepspeed_internals)
    # DeepSpeed JSON; default ds_configs/zero{stage}.json or pipeline.json
    ds_config: str | None = field(default=None, metadata=input_path("pass an existing file as parallel.ds_config"))
    # a rank that makes no progress in a step phase for this long ends the job (launch/failure.py); longer than
    # any phase of a 172B step, including a checkpoint save of its ~2.6 TB of state
    stall_timeout_s: float = field(default=1200.0, metadata=above(
        0, "seconds without progress before a stalled job ends"))
    # a rank that cannot reach the rendezvous, or ranks that never join it, end the job after this long
    rendezvous_timeout_s: float = field(default=60.0, metadata=above(
        0, "seconds for every rank to reach the rendezvous"))
    # over several hosts: a rank (or the rendezvous store) silent this long ends the job, naming its host
    # (launch/rendezvous.py); 0 turns the heartbeat off
    heartbeat_timeout_s: float = field(default=30.0, metadata=at_least(
        0, "seconds of silence before a host counts as lost (0: no heartbeat)"))


@dataclass
class PhaseConfig:
    """One precision phase, starting at ``start_step`` (or at ``start_tokens`` consumed, whichever is given)."""

    precision: str = "bf16"  # bf16 | fp8
    start_step: int = field(default=0, metadata=at_least(0))
    start_tokens: int | None = field(default=None, metadata=at_least(0))
    recipe: str = "delayed"  # delayed | current | block | auto (chosen at the flip by measured penalty)
    candidates: list[str] = field(default_factory=lambda: ["delayed", "current", "block"])  # for recipe: auto
    fallback: list[str] = field(default_factory=list)  # e.g. [current, block, bf16]: guard.penalty_action=fallback
    fp8_format: str = "hybrid"  # hybrid | e4m3
    amax_history_len: int = field(default=1024, metadata=at_least(1))
    amax_compute_algo: str = "max"  # max | most_recent
    margin: int = field(default=0, metadata=at_least(0, "the FP8 scale's margin, in powers of 2"))
    # delayed scaling: BF16 steps that record amax before the flip
    calibration_steps: int = field(default=1, metadata=at_least(0))


@dataclass
class GuardConfig:
    enabled: bool = True
    # running mean over this many steps before the flip
    window: int = field(default=20, metadata=at_least(1))
    # loss above factor x running mean ...
    factor: float = field(default=1.5, metadata=above(1, "a loss above factor x its running mean is diverging"))
    # ... for this many consecutive steps -> roll back
    patience: int = field(default=3, metadata=at_least(1))
    # FP8's loss penalty, valid_loss / valid_loss_bf16 - 1, measured at every validation in an FP8 phase; above
    # max_penalty for penalty_patience validations in a row -> penalty_action
    max_penalty: float = field(default=0.02, metadata=above(0, message=PENALTY_MESSAGE))
    penalty_patience: int = field(default=2, metadata=at_least(1, message=PENALTY_MESSAGE))
    penalty_action: str = "warn"  # warn | fallback (the phase's fallback chain) | bf16


@dataclass
class PrecisionConfig:
    dtype: str = "bf16"  # parameter / compute dtype outside FP8 GEMMs: bf16 | fp32
    phases: list[PhaseConfig] = field(default_factory=lambda: [PhaseConfig()])
    # keep the first N decoder layers in BF16 during FP8 phases, and the last N
    bf16_first_layers: int = field(default=0, metadata=at_least(0))
    bf16_last_layers: int = field(default=0, metadata=at_least(0))
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
    interval: int = field(default=1, metadata=at_least(1, "log every N steps"))
    progress: bool = True


@dataclass
class KeepRule:
    """One rule of ``checkpoint.keep``: below step ``below`` (every step from here on when None), every
    ``every``-th step is a kept save."""

    every: int = field(metadata=at_least(1, says="positive"))
    below: int | None = field(default=None, metadata=at_least(1, says="positive"))


@dataclass
class CheckpointConfig:
    interval: int = field(default=1000, metadata=at_least(0, "steps; 0 = only on signal and at the end"))
    keep_last: int = field(default=3, metadata=at_least(1))  # rotates the saves that no keep rule keeps
    # log-spaced saves that rotation never deletes (kept_step): a step is kept when the first rule whose below
    # it is under divides it. LLM-jp's Megatron schedule, every step below 10, every 10 below 100, every 100
    # below 10,000, then every 1000: [{every: 1, below: 10}, {every: 10, below: 100}, {every: 100, below: 10000},
    # {every: 1000}]. Their markers say kept, so a resume with other rules deletes none of them
    keep: list[KeepRule] = field(default_factory=list)
    grace_seconds: float = field(default=600.0, metadata=above(0, "time allowed for the save after SIGTERM"))
    save_at_end: bool = True  # false for throughput experiments that need no final checkpoint
    # the loop stops only to copy the state into host memory; a thread per rank writes it (checkpoint/async_save.py)
    async_save: bool = True
    # signals that stop the run with a checkpoint (finish the step, save, exit 0), by name (SIGUSR1 or USR1): a
    # scheduler's early warning such as Slurm's --signal=USR1@120 can then ask for the save (stop_signals_of)
    stop_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGINT"])


HEALTH_ACTIONS = ("warn", "skip", "rollback", "stop")  # llmjp_ds.health.ACTIONS


@dataclass
class SpikeRule:
    """A value is a spike ``threshold`` robust standard deviations (1.4826 x the median absolute deviation of its
    recent history) and ``min_ratio`` times above that history's median; ``action`` is what is done about it."""

    action: str = field(default="warn", metadata=one_of(*HEALTH_ACTIONS, why="what a spike leads to"))
    threshold: float = field(default=6.0, metadata=above(0, "robust standard deviations above the median"))
    min_ratio: float = field(default=1.1, metadata=at_least(1, "times the median (a flat history's deviation is "
                                                                  "tiny)"))


@dataclass
class HealthConfig:
    """Loss and grad-norm spikes, non-finite steps and validation jumps (llmjp_ds/health.py): each kind's action
    (warn | skip the update | rollback to the newest checkpoint before it, skipping samples | stop)."""

    window: int = field(default=100, metadata=at_least(3, "values of history a spike is measured against"))
    # values of history before any verdict: the warm-up's falling loss is history, not a spike
    min_history: int = field(default=20, metadata=at_least(3))
    loss: SpikeRule = field(default_factory=SpikeRule)
    # measured in DeepSpeed's optimizer step, after the update: warn, rollback or stop
    grad_norm: SpikeRule = field(default_factory=lambda: SpikeRule(threshold=10.0, min_ratio=2.0))
    valid_loss: SpikeRule = field(default_factory=lambda: SpikeRule(threshold=6.0, min_ratio=1.02))
    # a non-finite loss or gradient: skip (DeepSpeed's optimizer skips it; train.max_nonfinite_steps in a row stop the
    # run), rollback or stop
    nonfinite: str = field(default="skip", metadata=one_of("skip", "rollback", "stop",
                                                           why="what a non-finite step leads to"))
    # a rollback goes to the newest checkpoint at least rollback_before steps before the spike (1: before the update
    # that preceded it, which may have caused it; PaLM went back ~100 steps)
    rollback_before: int = field(default=1, metadata=at_least(0))
    # and skips the steps from that checkpoint's to the spike's (skip_before null), or from this many steps before
    # the spike; and skip_after steps after it (PaLM skipped a few hundred batches)
    skip_before: int | None = field(default=None, metadata=at_least(0))
    skip_after: int = field(default=0, metadata=at_least(0))
    # more rollbacks than this within rollback_window steps end the run with one line instead of looping
    max_rollbacks: int = field(default=3, metadata=at_least(1))
    rollback_window: int = field(default=1000, metadata=at_least(1))


@dataclass
class RunConfig:
    run_dir: str = field(default="runs/default", metadata=output_path(own=True))
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    health: HealthConfig = field(default_factory=HealthConfig)

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
    lr / 10 (Megatron-LM's schedule, as LLM-jp trained with it), z-loss 1e-4, seq 4096, 2.1T tokens."""
    return RunConfig(
        run_dir=f"runs/llmjp3-{size}",
        model=ModelConfig(shape=f"llmjp3-{size}", z_loss=1e-4),
        data=DataConfig(order="megatron"),  # LLM-jp trained with Megatron-LM: its samples, in its order
        optim=OptimConfig(lr=lr, min_lr_ratio=0.1, warmup_steps=2000, beta1=0.9, beta2=0.95, eps=1e-8,
                          weight_decay=0.1, clip_grad=1.0, schedule="megatron"),
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


# LLM-jp's log-spaced saves: every step below 10, every 10 below 100, every 100 below 10k, then every 1000
LLMJP_LOG_SPACED = [KeepRule(every=1, below=10), KeepRule(every=10, below=100), KeepRule(every=100, below=10_000),
                    KeepRule(every=1000)]


def _preset_llmjp4(size: str) -> RunConfig:
    """LLM-jp-4's stable run (llm-jp/scripts pretrain/scripts/v4-8b-phase1/base/params.sh): AdamW (0.9, 0.95, 1e-8),
    weight decay 0.1, clip 1.0, LR 3e-4 with min 3e-5, 2000 warm-up steps, then WSD with the decay left out
    (--lr-wsd-decay-iters 1 at 12M iterations: decay branches add it, llmjp-ds branch), global batch 512 of
    micro-batches of 1, seq 4096, BF16 throughout, no z-loss (the v4 arguments pass none), no validation (--split
    1,0,0), distributed optimizer (ZeRO-1), log-spaced saves. The tokenizer (v4, 196,608 pieces) and the corpora
    are the user's: data.tokenizer and data.blend. The 32B's published settings are its shape and TP4; its
    schedule here is the 8B's."""
    return RunConfig(
        run_dir=f"runs/llmjp4-{size}",
        model=ModelConfig(shape=f"llmjp4-{size}", z_loss=0.0),
        data=DataConfig(order="megatron", split=[1.0, 0.0, 0.0]),
        optim=OptimConfig(lr=3e-4, min_lr_ratio=0.1, warmup_steps=2000, decay_steps=None, schedule="megatron",
                          decay_style="WSD", wsd_decay_steps=1, wsd_decay_style="linear", beta1=0.9, beta2=0.95,
                          eps=1e-8, weight_decay=0.1, clip_grad=1.0),
        train=TrainConfig(steps=12_000_000, global_batch_size=512, micro_batch_size=1, eval_interval=0),
        parallel=ParallelConfig(zero_stage=1, tensor_parallel=4 if size == "32b" else 1),
        precision=PrecisionConfig(dtype="bf16"),
        checkpoint=CheckpointConfig(interval=0, keep=list(LLMJP_LOG_SPACED)))


RUN_PRESETS: dict[str, Callable[[], RunConfig]] = {
    "demo": _preset_demo,
    "llmjp3-1.8b": lambda: _preset_llmjp3("1.8b", 3e-4, 512),
    "llmjp3-3.7b": lambda: _preset_llmjp3("3.7b", 3e-4, 1024),
    "llmjp3-13b": lambda: _preset_llmjp3("13b", 2e-4, 1024),
    "llmjp3-172b": _preset_172b,
    "llmjp4-8b": lambda: _preset_llmjp4("8b"),
    "llmjp4-32b": lambda: _preset_llmjp4("32b"),
}


def preset_dict(name: str, source: str = "") -> dict:
    """The run preset ``name`` as a plain dict (the base that files and ``--set`` are merged over); ``source``
    says where the name was given, for the message."""
    if name not in RUN_PRESETS:
        fail(f"unknown run preset {name!r}{source}{did_you_mean(name, RUN_PRESETS)}: choose one of "
             f"{', '.join(RUN_PRESETS)}")
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


def _build_value(value: Any, annotation, where: str, may_be_empty: bool = False):
    """``value`` as ``annotation``: a dataclass from a mapping, a list of dataclasses from a list of mappings
    (``may_be_empty``: an empty list too)."""
    if dataclasses.is_dataclass(annotation):
        return build(annotation, value, where)
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        if dataclasses.is_dataclass(item):
            if not isinstance(value, list) or not (value or may_be_empty):
                fail(f"{where} must be a {'' if may_be_empty else 'non-empty '}list of {item.__name__} mappings")
            return [build(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, list):  # name the item that is wrong
            for i, v in enumerate(value):
                if not _type_ok(v, item):
                    fail(f"config key '{where}[{i}]' must be {_type_name(item)} (an item of {where}, a "
                         f"{_type_name(annotation)}), got {v!r}")
    if not _type_ok(value, annotation):
        fail(f"config key {where!r} must be {_type_name(annotation)}, got {value!r}")
    return value


def build(cls, data: dict, path: str = ""):
    """Instantiate dataclass ``cls`` from a nested dict, rejecting unknown keys and wrong types."""
    if not isinstance(data, dict):
        fail(f"config section {path or '<root>'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    names = set(by_name)
    kwargs = {}
    for key, value in data.items():
        if not isinstance(key, str):  # a YAML key such as 1, true or null
            fail(f"config key {key!r} {'in ' + path if path else 'at the top level'} is not a name (it is "
                 f"{type(key).__name__}): config keys are names such as optim or lr")
        where = f"{path}.{key}" if path else key
        if key not in names:
            _renamed(where)
            fail(f"unknown config key {where!r}{did_you_mean(key, names)}")
        # a list whose default is empty (checkpoint.keep) may be empty; one with a default item (phases) not
        empty_default = by_name[key].default_factory is list
        kwargs[key] = _build_value(value, hints[key], where, may_be_empty=empty_default)
    required = [name for name, f in by_name.items() if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING and name not in kwargs]
    if required:
        fail(f"config section {path or '<root>'} lacks {', '.join(required)}: set "
             f"{' and '.join(f'{name}: <value>' for name in required)} there")
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

    if not text.strip():
        return text  # `key=` sets an empty string (YAML would read null); `key=null` unsets
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
    parts = [part.strip() for part in key.split(".")]
    if not all(parts):
        fail(f"--set {assignment!r}: the key {key.strip()!r} has an empty name between its dots: write it as "
             "section.name=value, e.g. optim.lr=1e-4")
    update: dict = {}
    node = update
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = parse_value(raw)
    return merge(data, update)


def load_file(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        fail(f"config file {path} does not exist: pass the path of a YAML or JSON run config (or use --preset)")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        fail(f"cannot read config file {path} ({exc}): pass a UTF-8 YAML or JSON file")
    if text.startswith("\ufeff"):
        fail(f"config file {path} starts with a byte-order mark (BOM): save it as UTF-8 without a BOM")
    try:
        if path.suffix == ".json":
            data = json.loads(text) if text.strip() else None
            if data is not None:
                _check_json_keys(text, path)
        else:
            data = _load_yaml(text, path)
    except UserError:
        raise
    except Exception as exc:  # yaml / json syntax errors
        mark = getattr(exc, "problem_mark", None)  # yaml: where; json: msg + lineno/colno
        tag = re.search(r"constructor for the tag '([^']*)'", str(getattr(exc, "problem", "")))
        if tag and mark is not None:
            fail(f"config file {path}: the YAML tag {tag[1].replace('tag:yaml.org,2002:', '!!')} at line "
                 f"{mark.line + 1} is not allowed: a run config holds plain values (numbers, strings, lists, "
                 "mappings); remove the tag")
        if mark is not None:
            where = f"{getattr(exc, 'problem', None) or str(exc).splitlines()[0]} at line {mark.line + 1}, column " \
                    f"{mark.column + 1}"
        elif isinstance(exc, json.JSONDecodeError):
            where = f"{exc.msg} at line {exc.lineno}, column {exc.colno}"
        else:
            where = str(exc).splitlines()[0]
        fail(f"cannot parse config file {path}: {where}; fix the syntax there")
    if data is None:
        fail(f"config file {path} is empty (no settings, only blank lines or comments): put the run's settings in "
             "it (see the presets in llmjp_ds/config.py), or leave out --config")
    if not isinstance(data, dict):
        fail(f"config file {path} holds a {type(data).__name__}, not a mapping of sections (run_dir, model, data, "
             "optim, train, ...): see the presets in llmjp_ds/config.py")
    return data


def _duplicate_key(path: Path, where: str, first: int, second: int) -> None:
    fail(f"config file {path}: key {where!r} is given twice, at lines {first} and {second} (the last would "
         "silently win): keep one")


def _load_yaml(text: str, path: Path):
    """``yaml.safe_load``, refusing a key given twice in one mapping and keys that are not strings."""
    import yaml

    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_yaml_keys(node, path, "", set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_yaml_keys(node, path: Path, where: str, visited: set) -> None:
    import yaml

    if id(node) in visited:  # an alias: checked where its anchor is
        return
    visited.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_yaml_keys(item, path, f"{where}[{i}]", visited)
    elif isinstance(node, yaml.MappingNode):
        lines: dict[str, int] = {}
        for key, value in node.value:
            if key.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: keys beside it override, as YAML means
                continue
            line = key.start_mark.line + 1
            if not (isinstance(key, yaml.ScalarNode) and key.tag == "tag:yaml.org,2002:str"):
                kind = key.tag.rsplit(":", 1)[-1]
                shown = key.value if isinstance(key, yaml.ScalarNode) else f"<a {kind}>"
                fail(f"config file {path}, line {line}: the key {shown} {'in ' + where if where else 'at the top'} "
                     f"is a YAML {kind}, not a name: config keys are names such as optim or lr")
            name = f"{where}.{key.value}" if where else key.value
            if key.value in lines:
                _duplicate_key(path, name, lines[key.value], line)
            lines[key.value] = line
            _check_yaml_keys(value, path, name, visited)


_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[{}\[\]:,]|[^\s{}\[\]:,"]+')


def _check_json_keys(text: str, path: Path) -> None:
    """A key given twice in one object of (valid) JSON, with both lines; ``json.loads`` would keep the last."""
    stack: list[dict] = []  # open objects and arrays: where they are and what they hold so far
    line, last = 1, 0
    for m in _JSON_TOKEN.finditer(text):
        line, last = line + text.count("\n", last, m.start()), m.start()
        tok, top = m.group(), stack[-1] if stack else None
        if tok in "{[":
            inner = "" if top is None else (f"{top['where']}[{top['index']}]" if top["kind"] == "[" else
                                            (f"{top['where']}.{top['key']}" if top["where"] else top["key"]))
            stack.append({"kind": tok, "where": inner, "index": 0, "seen": {}, "key": None, "expect_key": True})
        elif tok in "}]":
            stack.pop()
        elif tok == ":" and top:
            top["expect_key"] = False
        elif tok == "," and top:
            top["expect_key"], top["index"] = True, top["index"] + 1
        elif tok.startswith('"') and top and top["kind"] == "{" and top["expect_key"]:
            key = json.loads(tok)
            if key in top["seen"]:
                _duplicate_key(path, f"{top['where']}.{key}" if top["where"] else key, top["seen"][key], line)
            top["seen"][key], top["key"] = line, key


def load_config(path: str | Path | None = None, sets: list[str] = (), preset: str | None = None) -> RunConfig:
    """Preset (from ``preset``, the file's ``preset:`` key, or ``demo``) <- file <- ``--set`` overrides."""
    data = load_file(path) if path else {}
    named = data.pop("preset", None)
    if named is not None and not (isinstance(named, str) and named.strip()):
        fail(f"config file {path}: preset must name a run preset ({', '.join(RUN_PRESETS)}), got {named!r}")
    if preset and named and preset != named:
        fail(f"--preset {preset} and the preset: {named} of config file {path} disagree: keep one")
    data = merge(preset_dict(preset or named or "demo", "" if preset or not named else f" named in {path}"), data)
    for assignment in sets:
        data = apply_set(data, assignment)
    return build(RunConfig, data)


# --- quantities derived from the config -----------------------------------------------------------------

def sample_counts(cfg: RunConfig) -> tuple[int, int]:
    """(train, valid) samples the run reads; no validation split is needed when ``eval_interval`` is 0. Under
    ``data.order: megatron`` the valid count is Megatron-LM's (:func:`megatron_sample_counts`)."""
    t = cfg.train
    if cfg.data.order == "megatron":
        return megatron_sample_counts(cfg)[:2]
    return train_samples(cfg), (max(1, t.eval_batches) * t.global_batch_size if t.eval_interval else 0)


def train_samples(cfg: RunConfig) -> int:
    """The samples the run's ``train.steps`` read: ``steps * global_batch_size`` (Megatron's ``train_iters * gbs``)
    when the batch is constant, the sum of the batch schedule's batches when it ramps or changes."""
    from llmjp_ds.batch_schedule import BatchSchedule

    return BatchSchedule.of(cfg.train).consumed_at(cfg.train.steps)


def megatron_sample_counts(cfg: RunConfig) -> tuple[int, int, int]:
    """(train, valid, test) sizes Megatron-LM asks its dataset builder for (``get_train_valid_test_num_samples``
    in megatron/training/training.py): ``train_iters * gbs`` (:func:`train_samples`), ``(train_iters // eval_interval + 1) * eval_iters
    * gbs`` (its evaluations never restart the validation iterator, and one more follows the last step) and
    ``eval_iters * gbs``, with train_iters = ``train.steps`` and eval_iters = ``train.eval_batches`` (at least 1,
    as our validation reads); no validation (``eval_interval`` 0) is eval_iters 0."""
    t = cfg.train
    eval_iters = max(1, t.eval_batches) if t.eval_interval else 0
    valid = (t.steps // t.eval_interval + 1) * eval_iters if t.eval_interval else 0
    return train_samples(cfg), valid * t.global_batch_size, eval_iters * t.global_batch_size


def blend_history(cfg: RunConfig, until_step: int) -> list[list]:
    """``[start_step, blend, count]`` of each data phase that governs a step before ``until_step`` (data.blend's
    as step 0's): two configs with the same history gave those steps the same samples' blends."""
    phases = [[0, [str(x) for x in cfg.data.blend], "run"]]
    phases += [[p.start_step, [str(x) for x in p.blend], p.count] for p in cfg.data.phases if p.start_step < until_step]
    return phases


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


# the interpreter's or the kernel's own signals: a handler of these would stop the run on a fault or a child's exit
NOT_STOP_SIGNALS = ("SIGCHLD", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT", "SIGTRAP", "SIGSYS", "SIGXFSZ")


def stop_signals_of(cfg: RunConfig) -> tuple:
    """``checkpoint.stop_signals`` as ``signal.Signals`` (a name with or without ``SIG``, any case), each once;
    one line naming the item that cannot be a stop signal."""
    import signal

    names, out = cfg.checkpoint.stop_signals, []
    if not names:
        fail("checkpoint.stop_signals is empty: then no signal stops the run with a checkpoint and a scheduler's "
             "SIGTERM loses every step since the last one; list at least SIGTERM, e.g. [SIGTERM, SIGINT]")
    known = [s.name for s in signal.Signals if not s.name.startswith("SIGRT")]
    for i, name in enumerate(names):
        full = name.strip().upper()
        full = full if full.startswith("SIG") else f"SIG{full}"
        where = f"checkpoint.stop_signals[{i}] {name!r}"
        if full in ("SIGKILL", "SIGSTOP"):
            fail(f"{where}: {full} cannot be caught (the kernel ends or stops the process without telling it), so it "
                 "cannot stop a run with a checkpoint; use SIGTERM, SIGINT, SIGUSR1 or SIGUSR2")
        if full in NOT_STOP_SIGNALS:
            fail(f"{where}: {full} is raised by the process itself (a fault or a child's exit), not a request to stop; "
                 "use SIGTERM, SIGINT, SIGUSR1 or SIGUSR2")
        if full not in known:
            fail(f"{where} is not a signal name{did_you_mean(full, known)}: use names such as SIGTERM, SIGINT, "
                 "SIGUSR1 or SIGUSR2 (`kill -l` lists them)")
        if signal.Signals[full] not in out:
            out.append(signal.Signals[full])
    return tuple(out)


# --- which steps are saved: checkpoint.interval and the keep rules ----------------------------------------

def kept_step(step: int, rules: list[KeepRule]) -> bool:
    """Whether completed step ``step`` is a kept save: the first rule whose ``below`` is above it (or None)
    divides it; no rule applies above the last ``below``."""
    rule = next((r for r in rules if r.below is None or step < r.below), None)
    return rule is not None and step % rule.every == 0


def save_due(step: int, checkpoint: CheckpointConfig) -> bool:
    """Whether completed step ``step`` is saved: a multiple of ``checkpoint.interval`` (when not 0) or kept."""
    return bool(checkpoint.interval and step % checkpoint.interval == 0) or kept_step(step, checkpoint.keep)


def check_keep_rules(rules: list[KeepRule]) -> None:
    """One line for the first rule of ``checkpoint.keep`` that cannot be meant: ``every`` below 1, a rule after
    one without ``below`` (it could never apply), a ``below`` not above the one before (nothing would reach it)."""
    for i, rule in enumerate(rules):
        where = f"checkpoint.keep[{i}]"
        if rule.every < 1:
            fail(f"{where}.every must be positive, got {rule.every}: save every N steps with N >= 1")
        if i and rules[i - 1].below is None:
            fail(f"{where} follows checkpoint.keep[{i - 1}], which has no below and so covers every later step: "
                 f"remove {where}, or give checkpoint.keep[{i - 1}] a below")
        if i and rule.below is not None and rule.below <= rules[i - 1].below:
            fail(f"{where}.below must be above checkpoint.keep[{i - 1}].below ({rules[i - 1].below}), got "
                 f"{rule.below}: list the rules by increasing below, the last one without below")
