"""The run config's schema: one typed tree of dataclasses, a section each (model, data, optim, train, parallel,
precision, logging, checkpoint, health) under :class:`RunConfig`. Each field says what it may hold in its metadata
(:mod:`.rules`); the loader (:mod:`.load`) builds the tree from plain dicts with pydantic, which refuses unknown
keys (:func:`section`) and wrong types by these annotations."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated, dataclass_transform

from pydantic import ConfigDict, Field, WrapValidator

from llmjp_ds.config.rules import (DROPOUT_MESSAGE, LR_MESSAGE, PENALTY_MESSAGE, SEED, above, at_least, input_path,
                                   one_of, output_path, within)
from llmjp_ds.errors import did_you_mean, fail
from llmjp_ds.model.options import DROP_POLICIES, KERNEL_CHOICES, MOE_AUX_LOSSES, RECOMPUTE_MODES, ModelOptions
from llmjp_ds.model.shapes import ShapeOverrides


# a float field keeps an int as it was written (``split: [99990, 8, 2]`` is said back so in a message); any other
# value is pydantic's strict float's
Real = Annotated[float, WrapValidator(lambda value, strict_float: value if type(value) is int else strict_float(value))]


@dataclass_transform(field_specifiers=(field,))
def section(cls):
    """A config section: a dataclass whose loader refuses the keys it does not declare."""
    cls = dataclass(cls)
    cls.__pydantic_config__ = ConfigDict(extra="forbid")
    return cls


# model.overrides: a shape's fields, each positive (ModelConfig's rule), but the layer indices of dense_layers
ModelOverrides = dataclasses.make_dataclass(
    "ModelOverrides", [("dense_layers", list[int] | None, field(default=None, metadata=at_least(
        0, "a layer index (from 0)")))], bases=(ShapeOverrides,),
    namespace={"__doc__": ShapeOverrides.__doc__, "__module__": __name__, "__pydantic_config__": {"extra": "forbid"}})


@section
class ModelConfig:
    shape: str = "tiny"  # a name in llmjp_ds.model.shapes.MODEL_SHAPES
    # e.g. {num_layers: 2}; every field of a shape is a positive number
    overrides: ModelOverrides = field(default_factory=ModelOverrides, metadata=above(0, says="a positive {type}"))
    backend: str = "auto"  # auto | te | torch
    z_loss: Real = field(default=1e-4, metadata=at_least(0, "the z-loss coefficient; 0 = off"))
    # the standard deviation of the weights' normal initialisation (Megatron-LM's --init-method-std; the output
    # projections' is it over sqrt(2 x layers), as Megatron's); LLM-jp's MoE runs use 0.006
    init_std: Real = field(default=0.02, metadata=above(0, "the initial weights' standard deviation"))
    # Megatron-LM's --attention-dropout / --hidden-dropout: llmjp-ds's layers apply no dropout (LLM-jp trains without
    # it), so 0 is the one value, and a config that asks for more is refused rather than trained without it
    attention_dropout: Real = field(default=0.0, metadata=within(0, 0, message=DROPOUT_MESSAGE))
    hidden_dropout: Real = field(default=0.0, metadata=within(0, 0, message=DROPOUT_MESSAGE))
    # activation recompute: none | selective (the attention core, as LLM-jp's 172B run) | full (every decoder layer)
    # | moe (an MoE model's MoE blocks, Megatron-LM's --recompute-modules moe)
    recompute: str = ModelOptions.recompute
    # on CUDA: the loss over bf16 logits as two Triton kernels, or one compiled kernel (model/loss.py)
    fused_loss: bool = True
    # TE backend: the QKV split and both RoPE rotations as one fused kernel (model/te_layers.split_qkv_rope): triton
    # = ours, rotating Q and K in place in the QKV output (model/kernels/rope.py), true or te = TE's, false = none
    fused_qkv_rope: bool | str = ModelOptions.fused_qkv_rope
    # TE backend: the causal attention core of training and evaluation. te = TE's DotProductAttention; cudnn =
    # torch's scaled_dot_product_attention on its cuDNN backend: the same cuDNN kernels for a third of the host's
    # time per call, but the Q, K, V gradients come back as three tensors, which RoPE's backward then packs (one
    # more pass over V's). For steps whose profile shows the GPU waiting on the attention's host work
    attention_core: str = ModelOptions.attention_core
    # TE backend: each residual's gradient is added inside the backward of the norm that reads the residual (TE's
    # rmsnorm_bwd_add), not by autograd in a kernel of its own (model/residual_grad.py). Off under recompute: full
    fused_residual_norm: bool = ModelOptions.fused_residual_norm
    # an MoE model's router (Megatron-LM's --moe-* names): the load-balancing loss (aux_loss, seq_aux_loss or none)
    # and its coefficient, the router z-loss's, dropless routing (null) or each expert's capacity as a factor of its
    # even share, and which tokens an expert over capacity keeps (probs: the highest weights; position: the earliest)
    moe_aux_loss: str = field(default=ModelOptions.moe_aux_loss, metadata=one_of(
        *MOE_AUX_LOSSES, why="the router's load-balancing loss"))
    moe_aux_loss_coeff: Real = field(default=ModelOptions.moe_aux_loss_coeff, metadata=at_least(0))
    moe_z_loss_coeff: Real = field(default=ModelOptions.moe_z_loss_coeff, metadata=at_least(0))
    moe_capacity_factor: Real | None = field(default=ModelOptions.moe_capacity_factor, metadata=above(
        0, "an expert's capacity as a factor of its even share of the choices; null = dropless"))
    moe_drop_policy: str = field(default=ModelOptions.moe_drop_policy, metadata=one_of(
        *DROP_POLICIES, why="which tokens an expert over capacity keeps"))
    # start from an HF checkpoint (continued pretraining): llama, qwen3 or qwen3_moe
    init_from_hf: str | None = field(default=None, metadata=input_path(
        "pass the directory save_pretrained wrote (config.json and safetensors)", inside="config.json"))
    # a fine-tune start (Megatron-LM's --finetune): the weights of another run's checkpoint, a run directory (its
    # latest) or RUN/checkpoints/stepNNNNNNNN, with a new optimizer, LR schedule and data position (step 1, sample 0).
    # Only the run's first start reads it, and checks it then (checkpoint/finetune.py): a restart resumes the run's
    # own checkpoints whether the source is still there or not
    init_from_checkpoint: str | None = None

    def __post_init__(self):
        for key, choices in KERNEL_CHOICES.items():
            value = getattr(self, key)
            if not any(type(value) is type(c) and value == c for c in choices):
                names = ", ".join(str(c).lower() if isinstance(c, bool) else c for c in choices)
                fail(f"model.{key} must be one of {names}, got {value!r}"
                     f"{did_you_mean(str(value), [str(c) for c in choices])}")
        if self.init_from_hf and self.init_from_checkpoint:
            fail("model.init_from_hf and model.init_from_checkpoint both give the first weights: keep one")




DATA_ORDERS = ("llmjp", "megatron")
PHASE_COUNTS = ("run", "phase")


@section
class DataPhase:
    """From ``start_step`` on, the run reads ``blend``. ``count: run``: the new blend's samples at the run's
    consumed-sample count, sized to the whole run (Megatron-LM restarted with another --data-path); ``phase``: from
    the new blend's first sample, sized to the phase (Megatron-LM's --phase-transition-iterations)."""

    start_step: int = field(default=2, metadata=at_least(2, "the first step of the phase; step 1 is data.blend's"))
    blend: list[Real | str] = field(default_factory=list, metadata=at_least(0, "a corpus weight"))
    count: str = field(default="run", metadata=one_of(*PHASE_COUNTS, why="where the new blend's samples start"))


@section
class DataConfig:
    # Megatron-style blend "w1 prefix1 w2 prefix2 ..." (or one prefix); empty = the bundled demo corpus
    blend: list[Real | str] = field(default_factory=list, metadata=at_least(0, "a corpus weight"))
    # .model file or HF tokenizer dir; exported with the model
    tokenizer: str | None = field(default=None, metadata=input_path(
        "pass a SentencePiece .model or an HF tokenizer dir"))
    seq_len: int | None = field(default=None, metadata=at_least(1))  # default: the model's max_position_embeddings
    split: list[Real] = field(default_factory=lambda: [0.99, 0.01],  # train / valid [/ test] shares of documents
                               metadata=at_least(0, "a share of the documents"))
    seed: int = field(default=1234, metadata=SEED)  # Megatron-LM's --seed under order: megatron
    cache_dir: str | None = field(default=None, metadata=output_path())
    # which samples, in which order: llmjp (data/dataset.py: per-epoch shuffles, divisor blend, prefix-stable) or
    # megatron (megatron-core's BlendedMegatronDatasetBuilder + GPTDataset, as Megatron-LM's pretrain_gpt.py: the
    # same blend, seq_len, seed, split and run length give Megatron's windows; needs llmjp-ds[megatron])
    order: str = field(default="llmjp", metadata=one_of(*DATA_ORDERS, why="the sample order"))
    # the blend changes at given steps (a decay branch with another mix, a mid-training phase): data/phases.py
    phases: list[DataPhase] = field(default_factory=list)


@section
class OptimConfig:
    lr: Real = field(default=3e-4, metadata=above(0, message=LR_MESSAGE))
    # the LR the decay ends at: min_lr (Megatron-LM's --min-lr, absolute) or lr * min_lr_ratio; one of the two, and
    # neither is a ratio of 0.1 (DEFAULT_MIN_LR_RATIO)
    min_lr_ratio: Real | None = field(default=None, metadata=within(0, 1, message=LR_MESSAGE))
    min_lr: Real | None = field(default=None, metadata=at_least(0, "the LR the decay ends at, Megatron's --min-lr"))
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
    warmup_init_lr: Real = field(default=0.0, metadata=at_least(0))  # the warmup's first LR (--lr-warmup-init)
    beta1: Real = field(default=0.9, metadata=within(0, 1, "AdamW's moment decay", hi_open=True))
    beta2: Real = field(default=0.95, metadata=within(0, 1, "AdamW's moment decay", hi_open=True))
    eps: Real = field(default=1e-8, metadata=above(0, "AdamW's denominator term"))
    weight_decay: Real = field(default=0.1, metadata=at_least(0))  # not on norm weights; --start-weight-decay
    # the weight decay at train.steps (--end-weight-decay), reached by weight_decay_incr_style (constant | linear |
    # cosine, --weight-decay-incr-style); None: constant at weight_decay
    end_weight_decay: Real | None = field(default=None, metadata=at_least(0))
    weight_decay_incr_style: str = "constant"
    clip_grad: Real = field(default=1.0, metadata=at_least(0, "the gradient-norm clip; 0 = off"))
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
        if self.min_lr is not None and self.min_lr_ratio is not None:
            fail(f"optim.min_lr={self.min_lr} and optim.min_lr_ratio={self.min_lr_ratio} both give the LR the decay "
                 "ends at: keep one and set the other to null (e.g. --set optim.min_lr_ratio=null beside "
                 "optim.min_lr, Megatron's --min-lr)")

    @property
    def end_lr(self) -> float:
        """The LR the decay ends at: ``min_lr``, else ``lr x min_lr_ratio`` (0.1 when neither is set)."""
        if self.min_lr is not None:
            return float(self.min_lr)
        return self.lr * (DEFAULT_MIN_LR_RATIO if self.min_lr_ratio is None else self.min_lr_ratio)


DEFAULT_MIN_LR_RATIO = 0.1  # optim.min_lr_ratio when neither it nor optim.min_lr is set
LR_SCHEDULES = ("llmjp", "megatron")  # optim.schedule: the conventions of llmjp_ds.optim.lr_schedule.LRSchedule
# megatron-core's OptimizerParamScheduler's styles, by its names
DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
WEIGHT_DECAY_INCR_STYLES = ("constant", "linear", "cosine")
RESUME_SCHEDULES = ("check", "override", "checkpoint")
# the optim fields that name a choice, and what each may be
OPTIM_CHOICES = {"schedule": LR_SCHEDULES, "decay_style": DECAY_STYLES, "wsd_decay_style": WSD_DECAY_STYLES,
                 "weight_decay_incr_style": WEIGHT_DECAY_INCR_STYLES, "resume_schedule": RESUME_SCHEDULES}


@section
class BatchChange:
    """From step ``start_step`` on, the global batch is ``global_batch_size`` (a change at step 1 sets the first
    batch)."""

    start_step: int = field(default=1, metadata=at_least(1, "a step number; the first step is 1"))
    global_batch_size: int = field(default=1, metadata=at_least(1, says="positive"))


@section
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
    # ranges [first, last] of steps whose samples are read and not trained on, the LR schedule not advancing over
    # them: Megatron-LM's --iterations-to-skip N is [N, N]; a rollback adds its own
    skip_steps: list[list[int]] = field(default_factory=list, metadata=at_least(1, "a step number; the first is 1"))
    seed: int = field(default=42, metadata=SEED)
    eval_interval: int = field(default=0, metadata=at_least(0, "0 = no validation"))
    eval_batches: int = field(default=4, metadata=at_least(0))
    max_nonfinite_steps: int = field(default=5, metadata=at_least(
        1, "consecutive skipped steps before the run stops"))


@section
class ParallelConfig:
    zero_stage: int = field(default=1, metadata=one_of(0, 1, 2, 3))
    pipeline_stages: int = field(default=1, metadata=at_least(1))
    # TE's tensor parallelism inside each layer; its ranks are adjacent (one node)
    tensor_parallel: int = field(default=1, metadata=at_least(1))
    sequence_parallel: bool | None = None  # default: on when tensor_parallel > 1
    # an MoE model's experts split over this many data-parallel ranks (Megatron's EP within DP; docs/moe.md)
    expert_parallel: int = field(default=1, metadata=at_least(1))
    partition_method: str = "flops"  # or DeepSpeed's: type:DecoderLayerPipe | parameters | uniform
    fused_grad_accumulation: bool = True  # one-pass fp32 accumulation (parallel.deepspeed_internals)
    # DeepSpeed JSON; default ds_configs/zero{stage}.json or pipeline.json
    ds_config: str | None = field(default=None, metadata=input_path("pass an existing file as parallel.ds_config"))
    # a rank that makes no progress in a step phase for this long ends the job (launch/failure.py); longer than
    # any phase of a 172B step, including a checkpoint save of its ~2.6 TB of state
    stall_timeout_s: Real = field(default=1200.0, metadata=above(
        0, "seconds without progress before a stalled job ends"))
    # a rank that cannot reach the rendezvous, or ranks that never join it, end the job after this long
    rendezvous_timeout_s: Real = field(default=60.0, metadata=above(
        0, "seconds for every rank to reach the rendezvous"))
    # over several hosts: a rank (or the rendezvous store) silent this long ends the job, naming its host
    # (launch/rendezvous.py); 0 turns the heartbeat off
    heartbeat_timeout_s: Real = field(default=30.0, metadata=at_least(
        0, "seconds of silence before a host counts as lost (0: no heartbeat)"))
    # a collective that waits longer than this fails (the process group's timeout, torch.distributed's
    # init_process_group(timeout=...); Megatron-LM's --distributed-timeout-minutes x 60): long enough for the slowest
    # rank's longest pause, e.g. building the index of a 15T-token blend (LLM-jp-4 sets 120 minutes)
    distributed_timeout_s: Real = field(default=1800.0, metadata=above(
        0, "seconds a collective may wait for every rank"))


@section
class PhaseConfig:
    """One precision phase, starting at ``start_step`` (or at ``start_tokens`` consumed, whichever is given)."""

    precision: str = "bf16"  # bf16 | fp8
    start_step: int = field(default=1, metadata=at_least(1, "a step number; the first step is 1"))
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


@section
class GuardConfig:
    enabled: bool = True
    # running mean over this many steps before the flip
    window: int = field(default=20, metadata=at_least(1))
    # loss above factor x running mean ...
    factor: Real = field(default=1.5, metadata=above(1, "a loss above factor x its running mean is diverging"))
    # ... for this many consecutive steps -> roll back
    patience: int = field(default=3, metadata=at_least(1))
    # FP8's loss penalty, valid_loss / valid_loss_bf16 - 1, measured at every validation in an FP8 phase; above
    # max_penalty for penalty_patience validations in a row -> penalty_action
    max_penalty: Real = field(default=0.02, metadata=above(0, message=PENALTY_MESSAGE))
    penalty_patience: int = field(default=2, metadata=at_least(1, message=PENALTY_MESSAGE))
    penalty_action: str = "warn"  # warn | fallback (the phase's fallback chain) | bf16


@section
class PrecisionConfig:
    dtype: str = "bf16"  # parameter / compute dtype outside FP8 GEMMs: bf16 | fp32
    phases: Annotated[list[PhaseConfig], Field(min_length=1)] = field(default_factory=lambda: [PhaseConfig()])
    # keep the first N decoder layers in BF16 during FP8 phases, and the last N
    bf16_first_layers: int = field(default=0, metadata=at_least(0))
    bf16_last_layers: int = field(default=0, metadata=at_least(0))
    fp8_lm_head: bool = False  # FP8 phases: the LM head's GEMMs in FP8 too (LLM-jp and Megatron-LM keep it BF16)
    emulate_fp8: bool = False  # allow emulated FP8 where TE FP8 cannot run (CPU, GPUs before sm89)
    log_amax: bool = False
    fp8_weight_cache: bool = True  # FP8 phases: cast each weight once per step, reused by its micro-batches
    guard: GuardConfig = field(default_factory=GuardConfig)


@section
class LoggingConfig:
    wandb: str = "offline"  # online | offline | disabled
    project: str = "llmjp-ds"
    run_name: str | None = None
    interval: int = field(default=1, metadata=at_least(1, "log every N steps"))
    progress: bool = True
    # an MoE model's whole layer x expert load matrix in the record every N steps (and at the last); 0 = never
    expert_load_interval: int = field(default=100, metadata=at_least(0, "0 = never"))


@section
class KeepRule:
    """One rule of ``checkpoint.keep``: below step ``below`` (every step from here on when None), every
    ``every``-th step is a kept save."""

    every: int = field(metadata=at_least(1, says="positive"))
    below: int | None = field(default=None, metadata=at_least(1, says="positive"))


@section
class CheckpointConfig:
    interval: int = field(default=1000, metadata=at_least(0, "steps; 0 = only on signal and at the end"))
    keep_last: int = field(default=3, metadata=at_least(1))  # rotates the saves that no keep rule keeps
    # log-spaced saves that rotation never deletes (kept_step): a step is kept when the first rule whose below
    # it is under divides it. LLM-jp's Megatron schedule, every step below 10, every 10 below 100, every 100
    # below 10,000, then every 1000: [{every: 1, below: 10}, {every: 10, below: 100}, {every: 100, below: 10000},
    # {every: 1000}]. Their markers say kept, so a resume with other rules deletes none of them
    keep: list[KeepRule] = field(default_factory=list)
    grace_seconds: Real = field(default=600.0, metadata=above(0, "time allowed for the save after SIGTERM"))
    save_at_end: bool = True  # false for throughput experiments that need no final checkpoint
    # the loop stops only to copy the state into host memory; a thread per rank writes it (checkpoint/async_save.py)
    async_save: bool = True
    # signals that stop the run with a checkpoint (finish the step, save, exit 0), by name (SIGUSR1 or USR1): a
    # scheduler's early warning such as Slurm's --signal=USR1@120 can then ask for the save (stop_signals_of)
    stop_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGINT"])


HEALTH_ACTIONS = ("warn", "skip", "rollback", "stop")


@section
class SpikeRule:
    """A value is a spike ``threshold`` robust standard deviations (1.4826 x the median absolute deviation of its
    recent history) and ``min_ratio`` times above that history's median; ``action`` is what is done about it."""

    action: str = field(default="warn", metadata=one_of(*HEALTH_ACTIONS, why="what a spike leads to"))
    threshold: Real = field(default=6.0, metadata=above(0, "robust standard deviations above the median"))
    min_ratio: Real = field(default=1.1, metadata=at_least(1, "times the median (a flat history's deviation is "
                                                                  "tiny)"))


@section
class RouterRule:
    """An MoE router's collapse: an expert of some layer that got no token for ``starved_steps`` steps in a row;
    ``action`` is what is done about it (warn, rollback or stop)."""

    action: str = field(default="warn", metadata=one_of("warn", "rollback", "stop", why="what a collapse leads to"))
    starved_steps: int = field(default=100, metadata=at_least(1, "steps in a row without a token"))


@section
class HealthConfig:
    """Loss and grad-norm spikes, non-finite steps, validation jumps and an MoE router's collapse
    (llmjp_ds/health/monitor.py): each kind's action (warn | skip the update | rollback to the newest checkpoint
    before it, skipping samples | stop)."""

    window: int = field(default=100, metadata=at_least(3, "values of history a spike is measured against"))
    # values of history before any verdict: the warm-up's falling loss is history, not a spike
    min_history: int = field(default=20, metadata=at_least(3))
    loss: SpikeRule = field(default_factory=SpikeRule)
    # measured in DeepSpeed's optimizer step, after the update: warn, rollback or stop
    grad_norm: SpikeRule = field(default_factory=lambda: SpikeRule(threshold=10.0, min_ratio=2.0))
    valid_loss: SpikeRule = field(default_factory=lambda: SpikeRule(threshold=6.0, min_ratio=1.02))
    router: RouterRule = field(default_factory=RouterRule)
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


@section
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

