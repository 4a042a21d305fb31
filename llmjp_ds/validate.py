"""The one entry point of config validation: :func:`validate_run`, run by ``train`` on every rank and by
``preflight`` on the login node, before any process group, GPU memory or heavy import exists. Every failure is
a :class:`~llmjp_ds.errors.UserError` of one line that names the problem and the fix."""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from pathlib import Path

from llmjp_ds.data.batch_schedule import check_batches
from llmjp_ds.config import (RECOMPUTE_MODES, REPO_ROOT, RunConfig, check_keep_rules, sequence_parallel_of,
                             stop_signals_of)
from llmjp_ds.errors import did_you_mean, fail
from llmjp_ds.optim.lr_schedule import check_schedule
from llmjp_ds.metrics.logger import WANDB_MODES
from llmjp_ds.model.backend import BACKENDS
from llmjp_ds.model.shapes import get_shape, resolve_shape
from llmjp_ds.parallel.ds_config import build_ds_config
from llmjp_ds.parallel.layout import Layout
from llmjp_ds.precision.recipes import AUTO, validate_phases


def validate_run(cfg: RunConfig, world_size: int | None = None, gpus_per_node: int | None = None) -> Layout:
    """Check ``cfg`` for a job of ``world_size`` ranks (default: ``$WORLD_SIZE``) with ``gpus_per_node`` ranks on
    each node (default: the launcher's ``$LOCAL_WORLD_SIZE``, if any); returns its layout."""
    check_values(cfg)
    check_paths(cfg)
    shape = resolve_shape(get_shape(cfg.model.shape), cfg.model.overrides)
    layout = Layout.of(cfg, world_size)
    _check_model(cfg, shape)
    _check_tensor_parallel(cfg, shape, gpus_per_node or gpus_per_node_from_env())
    _check_parallel(cfg, layout, shape.num_layers)
    _check_expert_parallel(cfg, shape, layout)
    _check_data(cfg)
    check_schedule(cfg.optim, cfg.train.steps)
    _check_logging(cfg)
    _check_health(cfg)
    stop_signals_of(cfg)  # names that are signals a handler may catch
    check_keep_rules(cfg.checkpoint.keep)  # log-spaced saves: rules in order of increasing below

    validate_phases(cfg.precision, shape.num_layers)
    if any(ph.recipe == AUTO for ph in cfg.precision.phases) and not cfg.train.eval_interval:
        fail("precision.phases: recipe auto chooses by the penalty measured on validation batches: set "
             "train.eval_interval > 0 (and a data.split with a valid share), or name the recipe")

    ds = build_ds_config(cfg, layout)  # the DeepSpeed JSON: exists, parses, has no optimizer/scheduler block
    zero = ds["zero_optimization"]
    if layout.expert > 1 and cfg.parallel.zero_stage == 2 and not (zero.get("contiguous_gradients", True)
                                                                    and zero.get("reduce_scatter", True)):
        fail("DeepSpeed's ZeRO-2 reduces the expert gradients of an MoE model only with contiguous_gradients and "
             "reduce_scatter: set both true in zero_optimization of the DeepSpeed config (parallel.ds_config), or "
             "use parallel.zero_stage=1")
    return layout


def validate_data(cfg: RunConfig) -> None:
    """What decides the samples a run reads, checked as :func:`validate_run` checks it (``llmjp-ds samples``):
    every value's rule, the data section's paths, the sequence length against the model, the data checks. Not the
    layout or the run directory: they change no sample."""
    check_values(cfg)
    check_paths(cfg, "data.")
    _check_model(cfg, resolve_shape(get_shape(cfg.model.shape), cfg.model.overrides))
    _check_data(cfg)


# --- every field by the rule declared beside it (config.Valid, config.PathRule) ---------------------------

def fields_of(obj, where: str = "", inherited=None):
    """(dotted key, value, rule metadata, type annotation, section) of every leaf field of the config tree;
    a rule declared on a field holding a dataclass is inherited by that dataclass's fields that declare none."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        key = f"{where}.{f.name}" if where else f.name
        value, meta = getattr(obj, f.name), f.metadata or inherited or {}
        if dataclasses.is_dataclass(value):
            yield from fields_of(value, key, f.metadata or None)
        elif isinstance(value, list) and value and all(dataclasses.is_dataclass(v) for v in value):
            for i, item in enumerate(value):
                yield from fields_of(item, f"{key}[{i}]")
        else:
            yield key, value, meta, hints[f.name], obj


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_values(cfg: RunConfig) -> None:
    """Every number of the config (a list's numbers one by one) finite and within its field's :class:`Valid`, and
    every string of a field with named choices one of them."""
    for key, value, meta, annotation, section in fields_of(cfg):
        valid = meta.get("valid")
        items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
        for i, v in items:
            if isinstance(v, str) and valid is not None and valid.choices:  # a named choice (data.order)
                if v not in valid.choices:
                    why = f" ({valid.why})" if valid.why else ""
                    fail(f"{key} must be {valid.text()}{why}, got {v!r}{did_you_mean(v, valid.choices)}")
                continue
            if not _is_number(v):
                continue
            where = key if i is None else f"{key}[{i}]"
            if not math.isfinite(v):
                bounds = f" {valid.text()}" if valid is not None and not valid.says else ""
                fail(f"{where} must be a finite number, got {v}: NaN and infinity are not settings; set a "
                     f"number{bounds}")
            if valid is None or valid.admits(v):
                continue
            if valid.message:
                fail(valid.message.format(where=where, value=v, section=section))
            why = f" ({valid.why})" if valid.why else ""
            fail(f"{where} must be {valid.text().format(type=_plain_type(annotation))}{why}, got {v!r}")


def _plain_type(annotation) -> str:
    """int for ``int | None``, float for ``list[float]``."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    return _plain_type(args[0]) if typing.get_args(args[0]) else getattr(args[0], "__name__", str(args[0]))


def check_paths(cfg: RunConfig, section: str = "") -> None:
    """Every path field (of ``section`` only, if given) by its :class:`~llmjp_ds.config.PathRule`: an input
    exists, an output can be made."""
    for key, value, meta, _, _ in fields_of(cfg):
        rule = meta.get("path")
        if rule is None or value is None or not key.startswith(section):
            continue
        if not value.strip():
            fix = "give the run a directory of its own, e.g. runs/my-run" if rule.own else \
                "set a path, or leave it unset (null)"
            fail(f"{key} is empty ({value!r}): {fix}")
        path = Path(value)
        if rule.kind == "input":
            if not path.exists():
                fail(f"{key} {path} does not exist: {rule.fix}")
            if rule.inside and not (path / rule.inside).is_file():
                fail(f"{key} {path} has no {rule.inside}: {rule.fix}")
            continue
        if rule.own:
            _check_own_directory(key, path)
        existing = path
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            fail(f"{key} {path}: {existing} is a file, not a directory; choose another {key}")
        if not os.access(existing, os.W_OK | os.X_OK):
            fail(f"{key} {path} is not writable ({existing} is read-only for this user): choose another {key} "
                 "or fix its permissions or mount")


def _check_own_directory(key: str, path: Path) -> None:
    """A run writes checkpoints/, metrics.jsonl, config.yaml and tokenizer/ into its run_dir, and resumes from
    whatever ``checkpoints/latest`` there names: it must not be a directory that holds other things."""
    here = path.resolve()
    try:
        home = Path.home().resolve()
    except RuntimeError:  # no $HOME and no passwd entry
        home = None
    for name, place in (("the filesystem root", Path(here.anchor)), ("your home directory", home),
                        ("the current directory", Path.cwd().resolve()), ("the repository", REPO_ROOT)):
        if place is None:
            continue
        if here == place:
            fail(f"{key} {path} is {name}: a run writes checkpoints/, metrics.jsonl and tokenizer/ into its "
                 f"{key}; give it a directory of its own, e.g. runs/my-run")
        if here in place.parents:
            fail(f"{key} {path} holds {name} ({place}): a run writes checkpoints/, metrics.jsonl and tokenizer/ "
                 f"into its {key}; give it a directory of its own, e.g. runs/my-run")


def _check_model(cfg: RunConfig, shape) -> None:
    if cfg.model.backend not in BACKENDS:
        fail(f"model.backend {cfg.model.backend!r} is not one of {', '.join(BACKENDS)}")
    if cfg.data.seq_len is not None and cfg.data.seq_len > shape.seq_len:
        fail(f"data.seq_len={cfg.data.seq_len} exceeds the model's max_position_embeddings {shape.seq_len}: lower "
             "it or set model.overrides.seq_len")
    if cfg.precision.dtype not in ("bf16", "fp32"):
        fail(f"precision.dtype must be bf16 or fp32, got {cfg.precision.dtype!r}")
    if cfg.model.recompute not in RECOMPUTE_MODES:
        fail(f"model.recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {cfg.model.recompute!r}"
             f"{did_you_mean(str(cfg.model.recompute), RECOMPUTE_MODES)}")
    if cfg.model.recompute == "moe" and not shape.num_experts:
        fail(f"model.recompute=moe recomputes the MoE blocks, and model.shape {cfg.model.shape} has no experts: use "
             "model.recompute=selective (the attention core) or full (whole layers)")


def _check_parallel(cfg: RunConfig, layout: Layout, num_layers: int) -> None:
    p, t = cfg.parallel, cfg.train
    if p.pipeline_stages > 1 and p.zero_stage > 1:
        fail(f"ZeRO-{p.zero_stage} cannot be combined with pipeline parallelism (DeepSpeed shards gradients "
             "across micro-batches): use parallel.zero_stage=1 with pipeline_stages > 1")
    method = p.partition_method.lower()
    if method not in ("flops", "parameters", "uniform") and not (method.startswith("type:") and method[5:]):
        fail(f"unknown parallel.partition_method {p.partition_method!r}: use flops, parameters, uniform or "
             "type:<layer class regex>")
    if p.pipeline_stages > num_layers:
        fail(f"parallel.pipeline_stages={p.pipeline_stages} exceeds the model's {num_layers} layers: use at most "
             f"{num_layers} stages")
    if not layout.fits():
        fail(f"world size {layout.world} is not divisible by tensor_parallel x pipeline_stages = {p.tensor_parallel} "
             f"x {p.pipeline_stages}: launch a multiple of {p.tensor_parallel * p.pipeline_stages} ranks (nodes x "
             "GPUs), or change parallel.tensor_parallel / pipeline_stages")
    if t.global_batch_size % (t.micro_batch_size * layout.data):
        fail(f"train.global_batch_size={t.global_batch_size} is not divisible by micro_batch_size x data parallel "
             f"= {t.micro_batch_size} x {layout.data}: make it a multiple of {t.micro_batch_size * layout.data}")
    check_batches(t, layout.data)


def _check_expert_parallel(cfg: RunConfig, shape, layout: Layout) -> None:
    """An MoE model's layout and expert parallelism (docs/moe.md): the experts split evenly over groups of
    data-parallel ranks (a pipeline stage's), on the layouts DeepSpeed's MoE support trains correctly; no tensor
    parallelism, which the MoE block is not built for."""
    ep, experts = layout.expert, shape.num_experts
    if experts and layout.tensor > 1:
        fail(f"model.shape {cfg.model.shape} has experts and parallel.tensor_parallel={layout.tensor}: the MoE block "
             "is not split over the TP group (its weights would drift apart over sequence-parallel shards); use "
             "parallel.tensor_parallel=1 and split the experts with parallel.expert_parallel")
    if ep == 1:
        return
    if not experts:
        fail(f"parallel.expert_parallel={ep} splits an MoE model's experts, but model.shape {cfg.model.shape} is "
             "dense (no experts): set parallel.expert_parallel=1, or train an MoE shape (e.g. tiny-moe)")
    if experts % ep:
        fail(f"the model's {experts} experts are not divisible by parallel.expert_parallel={ep}: choose an "
             f"expert_parallel that divides {experts} ({', '.join(str(d) for d in (2, 4, 8) if experts % d == 0)})")
    if layout.fits() and layout.data % ep:
        fail(f"parallel.expert_parallel={ep} does not divide the data-parallel size {layout.data}: each "
             f"expert-parallel group is {ep} data-parallel ranks; launch a multiple of {ep} data-parallel ranks, or "
             "choose an expert_parallel that divides the data-parallel size")
    why = {0: "DeepSpeed's ZeRO-0 clipping averages the ranks' gradient norms (fp32) or leaves the experts out of "
              "the norm (bf16)", 3: "DeepSpeed refuses its MoE with ZeRO-3"}
    if cfg.parallel.zero_stage in why:
        fail(f"parallel.expert_parallel={ep} needs ZeRO-1 or ZeRO-2, not ZeRO-{cfg.parallel.zero_stage}: "
             f"{why[cfg.parallel.zero_stage]}; use parallel.zero_stage=1 or 2")


def gpus_per_node_from_env() -> int | None:
    """Ranks per node as the launcher says (torchrun: LOCAL_WORLD_SIZE; the deepspeed launcher: LOCAL_SIZE)."""
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return None


def _check_tensor_parallel(cfg: RunConfig, shape, gpus_per_node: int | None) -> None:
    tp = cfg.parallel.tensor_parallel
    if cfg.parallel.sequence_parallel and tp == 1:
        fail("parallel.sequence_parallel shards the sequence over the tensor-parallel group: set "
             "parallel.tensor_parallel > 1, or leave sequence_parallel unset")
    if tp == 1:
        return
    for what, n in (("num_attention_heads", shape.num_attention_heads), ("num_key_value_heads",
                    shape.num_key_value_heads), ("ffn_hidden_size", shape.ffn_hidden_size),
                    ("vocab_size (padded)", shape.vocab_size)):
        if n % tp:
            fail(f"the model's {what} {n} is not divisible by parallel.tensor_parallel={tp}: choose a tensor_parallel "
                 f"that divides it ({', '.join(str(d) for d in (2, 4, 8) if n % d == 0) or 'none of 2, 4, 8'})")
    seq = cfg.data.seq_len or shape.seq_len
    if sequence_parallel_of(cfg) and seq % tp:
        fail(f"sequence parallelism splits the sequence over the TP group: data.seq_len {seq} is not divisible by "
             f"parallel.tensor_parallel={tp}; change one, or set parallel.sequence_parallel=false")
    if gpus_per_node is not None and gpus_per_node % tp:
        fail(f"parallel.tensor_parallel={tp} does not divide the {gpus_per_node} GPUs (slots) of a node: a TP group "
             f"would span two nodes (every GEMM communicates over it); use a tensor_parallel that divides "
             f"{gpus_per_node}")
    if cfg.parallel.zero_stage == 3:
        fail("ZeRO-3 is not supported with tensor parallelism: use parallel.zero_stage=1 (or 2 without a pipeline)")


def _check_data(cfg: RunConfig) -> None:
    d = cfg.data
    if len(d.split) not in (2, 3) or d.split[0] <= 0:
        fail(f"data.split must be [train, valid] or [train, valid, test] shares with train > 0 (Megatron's --split "
             f"99990,8,2 is [99990, 8, 2]), got {d.split}")
    if cfg.train.eval_interval and not d.split[1] > 0:
        fail(f"train.eval_interval={cfg.train.eval_interval} validates on the valid split, but data.split {d.split} "
             "gives it no share: give it one (e.g. [99990, 8, 2]), or set train.eval_interval=0")
    if d.order == "megatron":
        from llmjp_ds.data.megatron_internals import FIX, megatron_core_problem

        problem = megatron_core_problem()
        if problem:
            fail(f"data.order=megatron reads Megatron's samples through megatron-core's dataset builder, but "
                 f"{problem}: {FIX}")
    if d.tokenizer is not None and not d.blend:
        fail(f"data.tokenizer {d.tokenizer} is set but data.blend is empty: the bundled demo corpus is read with "
             "its own tokenizer; set data.blend to corpora preprocessed with this tokenizer, or unset data.tokenizer")
    _check_phases(cfg)


def _check_phases(cfg: RunConfig) -> None:
    """``data.phases`` start after step 1, each once and in order, by the run's last step, each with a blend."""
    starts = [p.start_step for p in cfg.data.phases]
    if starts != sorted(set(starts)):
        fail(f"data.phases start at steps {starts}: list each step once, in increasing order")
    if starts and starts[-1] > cfg.train.steps:
        fail(f"data.phases changes the blend at step {starts[-1]}, but the run ends with step train.steps="
             f"{cfg.train.steps}: start it earlier or lengthen the run")
    for i, phase in enumerate(cfg.data.phases):
        if not phase.blend:
            fail(f"data.phases[{i}] (from step {phase.start_step}) has no blend: give it corpora as data.blend takes "
                 "them, e.g. [0.7, /data/ja_text_document, 0.3, /data/en_text_document]")
    if cfg.data.phases and not cfg.data.blend:
        fail("data.phases changes the blend of a run on the bundled demo corpus (data.blend is empty): give "
             "data.blend the corpora of the first phase")


def _check_health(cfg: RunConfig) -> None:
    """What the health monitor cannot do, and train.skip_steps' ranges."""
    for kind in ("grad_norm", "valid_loss"):
        if getattr(cfg.health, kind).action == "skip":
            fail(f"health.{kind}.action=skip: the {kind.replace('_', ' ')} is measured after the update it would skip "
                 "(DeepSpeed's optimizer step computes the gradient norm; validation follows the step): choose warn, "
                 "rollback or stop")
    _check_health_can_judge(cfg)
    ranges = cfg.train.skip_steps
    for i, r in enumerate(ranges):
        if len(r) != 2 or not r[0] <= r[1]:
            fail(f"train.skip_steps[{i}] {r} is not a range [first, last] of steps with first <= last: write it as "
                 "[first, last] (Megatron-LM's --iterations-to-skip N is [N, N])")


def _check_health_can_judge(cfg: RunConfig) -> None:
    """A health setting under which no verdict can ever be reached: a spike is judged against at least
    health.min_history values of a history that holds health.window, from step min_history + 1; a validation jump
    against three earlier validations."""
    h = cfg.health
    if h.window < h.min_history:
        fail(f"health.window={h.window} holds fewer values than health.min_history={h.min_history} asks for before "
             "any verdict: no loss or grad-norm spike would ever be judged; set health.window to at least "
             f"{h.min_history}, or lower health.min_history")
    for kind in ("loss", "grad_norm"):
        action = getattr(h, kind).action
        if action != "warn" and cfg.train.steps <= h.min_history:
            fail(f"health.{kind}.action={action} can never act: a spike is judged from step {h.min_history + 1} "
                 f"(after health.min_history={h.min_history} steps of history), and train.steps={cfg.train.steps}; "
                 "lower health.min_history, or lengthen the run")
    action, interval = h.valid_loss.action, cfg.train.eval_interval
    validations = cfg.train.steps // interval if interval else 0
    if action != "warn" and validations <= 3:
        fail(f"health.valid_loss.action={action} can never act: a validation jump is judged against 3 earlier "
             f"validations, and the run validates {validations} times (train.eval_interval={interval}, train.steps="
             f"{cfg.train.steps}); validate more often, or leave health.valid_loss.action at warn")


def _check_logging(cfg: RunConfig) -> None:
    if cfg.logging.wandb not in WANDB_MODES:
        fail(f"logging.wandb must be online, offline or disabled, got {cfg.logging.wandb!r}"
             f"{did_you_mean(cfg.logging.wandb, WANDB_MODES)}")
