"""``llmjp-ds import-megatron``: a Megatron-LM run at iteration N (weights, optimizer, data position) becomes a
llmjp-ds run at step N, which ``llmjp-ds train`` resumes so that its next step continues the Megatron run.

The Megatron checkpoint is read whole (:mod:`~llmjp_ds.interchange.megatron_reader`, any format and layout, expert
parallelism included), checked against the run config the user gives (the model's shape, an MoE model's experts,
router and losses (:mod:`~llmjp_ds.interchange.megatron_moe`), the vocabulary and the tokenizer, the sequence
length, the global batch), and written as a new run directory: ``config.yaml`` (the config, with the LR schedule,
AdamW's settings and the schedule's position taken from the checkpoint) and one checkpoint ``stepNNNNNNNN`` in the
layout-free form a resume on another layout reads (``parallel/reshape.py``: per parameter its fp32 master weight
and Adam moments, the optimizer step), with the trainer's state (step = Megatron's iteration, consumed samples =
``args.consumed_train_samples``), the marker and its manifest, and ``latest``. Every check runs before anything is
written; the run directory is built beside its place and renamed into it, and one that exists is refused.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import yaml

from llmjp_ds.data.batch_schedule import BatchSchedule, changes_at_thresholds, megatron_step_schedule
from llmjp_ds.checkpoint.client_state import ClientState
from llmjp_ds.checkpoint.manifest import digest, save_hashed
from llmjp_ds.checkpoint.readers import CLIENT_STATE
from llmjp_ds.checkpoint.store import LATEST, MARKER, CheckpointMeta, tag_for
from llmjp_ds.config import (DECAY_STYLES, WEIGHT_DECAY_INCR_STYLES, WSD_DECAY_STYLES, add_config_args, build_config,
                             load_config, model_config_of, seq_len_of)
from llmjp_ds.data.tokenizer import load_tokenizer
from llmjp_ds.errors import fail
from llmjp_ds.interchange import megatron_moe, megatron_reader
from llmjp_ds.interchange.megatron_adapter import from_megatron_state_dict, megatron_name
from llmjp_ds.interchange.megatron_reader import MegatronCheckpoint
from llmjp_ds.io_utils import atomic_directory
from llmjp_ds.model.shapes import has_qk_norm, pad_vocab_size, rope_theta
from llmjp_ds.parallel.reshape import CONVERTED, DONE


def _shape_pairs(ckpt: MegatronCheckpoint, cfg, model_config) -> list[tuple[str, object, str, object]]:
    """(Megatron argument, its value, config key, the config's value) of everything that must agree: the model's
    shape (an MoE model's experts too, :func:`~llmjp_ds.interchange.megatron_moe.config_pairs`; the dense FFN
    width only where a layer is dense), the sequence and the batch."""
    a = ckpt.arg
    heads = a("num_attention_heads")
    groups = a("num_query_groups") if a("group_query_attention", False) else heads
    moe_pairs = megatron_moe.config_pairs(ckpt.args, cfg, model_config)
    all_moe = megatron_moe.num_experts(ckpt.args) and not megatron_moe.dense_layers(ckpt.args)
    dense = [] if all_moe else [("ffn_hidden_size", a("ffn_hidden_size"), "model.overrides.ffn_hidden_size",
                                 model_config.intermediate_size)]
    return [("num_layers", a("num_layers"), "model.overrides.num_layers", model_config.num_hidden_layers),
            ("hidden_size", a("hidden_size"), "model.overrides.hidden_size", model_config.hidden_size),
            ("num_attention_heads", heads, "model.overrides.num_attention_heads", model_config.num_attention_heads),
            ("num_query_groups", groups, "model.overrides.num_key_value_heads", model_config.num_key_value_heads),
            *dense,
            ("kv_channels", a("kv_channels") or a("hidden_size") // heads, "model.overrides.head_dim",
             model_config.head_dim),
            ("padded_vocab_size", a("padded_vocab_size"), "model.overrides.vocab_size", model_config.vocab_size),
            ("rotary_base", float(a("rotary_base", 10000)), "model.overrides.rope_theta",
             rope_theta(model_config)),
            ("norm_epsilon", float(a("layernorm_epsilon", 1e-5)), "model.overrides.rms_norm_eps",
             float(model_config.rms_norm_eps)),
            ("qk_layernorm", bool(a("qk_layernorm", False)), "model.overrides.qk_norm", has_qk_norm(model_config)),
            *moe_pairs,
            ("seq_length", a("seq_length"), "data.seq_len", seq_len_of(cfg, model_config)),
            ("global_batch_size", a("global_batch_size"), "train.global_batch_size", cfg.train.global_batch_size),
            ("rampup_batch_size", [int(x) for x in a("rampup_batch_size") or []] or None, "train.batch_rampup",
             cfg.train.batch_rampup),
            ("step_batch_size_schedule", megatron_batch_changes(ckpt), "train.batch_changes",
             [[c.start_step, c.global_batch_size] for c in cfg.train.batch_changes])]


def megatron_batch_changes(ckpt: MegatronCheckpoint) -> list[list[int]]:
    """Megatron-Core 0.19's ``--step-batch-size-schedule`` of the run as ``train.batch_changes`` (``[start_step,
    batch]`` each; none without one)."""
    text = ckpt.arg("step_batch_size_schedule")
    if not text:
        return []
    return [list(c) for c in changes_at_thresholds(megatron_step_schedule(text, ckpt.arg("seq_length")))]


def check_config(ckpt: MegatronCheckpoint, cfg, model_config) -> None:
    """Refuse, in one line naming both values, a config that disagrees with the checkpoint."""
    for arg, theirs, key, ours in _shape_pairs(ckpt, cfg, model_config):
        if theirs != ours:
            shown = ("[" + ", ".join(f"{{start_step: {s}, global_batch_size: {b}}}" for s, b in theirs) + "]"
                     if key == "train.batch_changes" else "null" if theirs is None else
                     str(theirs).lower() if isinstance(theirs, bool) else theirs)
            fail(f"the Megatron checkpoint has {arg}={theirs}, the run config {key}={ours}: pass the config of the "
                 f"run that wrote it (--config / --preset / --set {key}={shown})")
    if cfg.parallel.zero_stage != 1:
        fail(f"parallel.zero_stage={cfg.parallel.zero_stage}: an imported run resumes from the layout-free form, "
             "which ZeRO-1 reads; set parallel.zero_stage=1")
    if cfg.train.steps <= ckpt.iteration:
        fail(f"train.steps={cfg.train.steps} but the Megatron run is already at iteration {ckpt.iteration}: set "
             "train.steps to the iteration the run should reach")
    _check_tokenizer(ckpt, cfg)


def _check_tokenizer(ckpt: MegatronCheckpoint, cfg) -> None:
    """The run's tokenizer pads (Megatron's rule: to a multiple of make_vocab_size_divisible_by x TP) to the
    checkpoint's embedding rows."""
    if not cfg.data.tokenizer:
        fail("data.tokenizer is not set: pass the tokenizer the Megatron run trained with (a SentencePiece .model "
             "or an HF tokenizer directory), e.g. --set data.tokenizer=PATH")
    pieces = load_tokenizer(cfg.data.tokenizer).vocab_size
    multiple = int(ckpt.arg("make_vocab_size_divisible_by", 128)) * int(ckpt.arg("tensor_model_parallel_size", 1))
    rows = ckpt.arg("padded_vocab_size")
    if pad_vocab_size(pieces, multiple) != rows:
        fail(f"the tokenizer {cfg.data.tokenizer} has {pieces} pieces, which Megatron pads to "
             f"{pad_vocab_size(pieces, multiple)} rows (a multiple of {multiple}), but the checkpoint's embedding has "
             f"{rows}: pass the tokenizer the Megatron run trained with (data.tokenizer)")


def consumed_samples(ckpt: MegatronCheckpoint) -> int:
    """The samples the Megatron run consumed (its argument; iterations x global batch in checkpoints without it)."""
    return int(ckpt.arg("consumed_train_samples") or ckpt.iteration * int(ckpt.arg("global_batch_size")))


def optim_settings(ckpt: MegatronCheckpoint, train_steps: int | None = None,
                   batches: BatchSchedule | None = None) -> dict:
    """The ``optim`` section that continues Megatron's schedule and AdamW: its counts in samples as the steps of
    ``batches`` (the run's batch schedule; default Megatron's constant global batch) that read them, its decay
    style (WSD with the length and style of its decay from the run's arguments, which the scheduler does not store),
    the warmup's first LR and the weight decay's increment (over ``train_steps``, the run's ``train.steps``, as
    Megatron's over ``--train-iters``)."""
    sched, gbs = ckpt.scheduler, int(ckpt.arg("global_batch_size"))
    batches = batches or BatchSchedule(gbs)
    where = f"{ckpt.directory}'s opt_param_scheduler"
    if not sched:
        fail(f"{ckpt.directory} holds no opt_param_scheduler: the LR schedule cannot be continued")
    style = sched.get("lr_decay_style", ckpt.arg("lr_decay_style"))
    if style not in DECAY_STYLES:
        fail(f"{where} decays the LR by {style!r}, not one of megatron-core's {', '.join(DECAY_STYLES)}: the "
             "checkpoint is not Megatron-LM's")
    counts = {k: int(sched[k]) for k in ("lr_warmup_steps", "lr_decay_steps", "num_steps")}
    if style == "WSD":  # Megatron-LM's get_optimizer_param_scheduler: iterations x global batch, or samples
        wsd_iters, wsd_samples = ckpt.arg("lr_wsd_decay_iters"), ckpt.arg("lr_wsd_decay_samples")
        if wsd_iters is None and wsd_samples is None:
            fail(f"{where} decays the LR by WSD, but the run's arguments hold neither lr_wsd_decay_iters nor "
                 "lr_wsd_decay_samples: the checkpoint is incomplete; import one that Megatron-LM wrote whole")
        counts["wsd_decay_steps"] = int(wsd_samples if wsd_iters is None else wsd_iters * gbs)
    start_wd, end_wd = float(sched.get("start_wd", 0.0)), float(sched.get("end_wd", 0.0))
    wd_style = sched.get("wd_incr_style", "constant")
    if wd_style not in WEIGHT_DECAY_INCR_STYLES:
        fail(f"{where} increments the weight decay by {wd_style!r}, not one of megatron-core's "
             f"{', '.join(WEIGHT_DECAY_INCR_STYLES)}: the checkpoint is not Megatron-LM's")
    if wd_style != "constant":
        counts["wd_incr_steps"] = int(sched["wd_incr_steps"])
    steps = {}
    for key, value in counts.items():
        if key == "wsd_decay_steps":  # a length at the decay's end: below, from where it starts
            continue
        steps[key] = batches.step_at(value)
        if batches.consumed_at(steps[key]) != value:
            fail(f"{where} has {key}={value} samples, which end inside step {steps[key]} of the run's batches "
                 "(train.global_batch_size, batch_rampup, batch_changes): llmjp-ds counts its schedule in steps")
    if counts["num_steps"] != consumed_samples(ckpt):
        fail(f"{where} is at {counts['num_steps']} samples, but the run consumed {consumed_samples(ckpt)}: the "
             "schedule was overridden; it cannot be continued step for step")
    if wd_style != "constant" and train_steps is not None and steps["wd_incr_steps"] != train_steps:
        fail(f"{where} raises the weight decay over {steps['wd_incr_steps']} iterations (Megatron's "
             f"--train-iters), the run config over train.steps={train_steps}: set train.steps="
             f"{steps['wd_incr_steps']}")
    max_lr, min_lr = float(sched["max_lr"]), float(sched["min_lr"])
    out = {"schedule": "megatron", "lr": max_lr, "min_lr_ratio": min_lr / max_lr,
           "warmup_steps": steps["lr_warmup_steps"], "decay_steps": steps["lr_decay_steps"],
           "decay_style": style, "warmup_init_lr": float(ckpt.arg("lr_warmup_init", 0.0) or 0.0),
           "beta1": float(ckpt.arg("adam_beta1", 0.9)), "beta2": float(ckpt.arg("adam_beta2", 0.999)),
           "eps": float(ckpt.arg("adam_eps", 1e-8)), "weight_decay": start_wd,
           "end_weight_decay": None if end_wd == start_wd else end_wd, "weight_decay_incr_style": wd_style,
           "clip_grad": float(ckpt.arg("clip_grad", 1.0))}
    if style == "WSD":
        wsd_style = ckpt.arg("lr_wsd_decay_style") or "exponential"  # Megatron-LM's default
        if wsd_style not in WSD_DECAY_STYLES:
            fail(f"the Megatron run's lr_wsd_decay_style {wsd_style!r} is not one of megatron-core's "
                 f"{', '.join(WSD_DECAY_STYLES)}: the checkpoint is not Megatron-LM's")
        # the decay's first step: the one after the last that starts within its stable samples
        stable_end = batches.step_at(counts["lr_decay_steps"] - counts["wsd_decay_steps"])
        if batches.consumed_at(stable_end) != counts["lr_decay_steps"] - counts["wsd_decay_steps"]:
            fail(f"{where}'s WSD decay starts inside step {stable_end} of the run's batches: llmjp-ds counts its "
                 "schedule in steps")
        out.update(wsd_decay_steps=steps["lr_decay_steps"] - stable_end, wsd_decay_style=wsd_style)
    return out


def layout_free_states(ckpt: MegatronCheckpoint, model_config) -> dict[str, dict]:
    """Per parameter (our names): its fp32 master weight and Adam moments (zeros where the checkpoint has no
    optimizer state)."""
    weights = from_megatron_state_dict(ckpt.weights, model_config)
    out = {}
    for name, weight in weights.items():
        state = (ckpt.optimizer or {}).get(megatron_name(name))
        if ckpt.optimizer is not None and state is None:
            fail(f"{ckpt.directory} holds no optimizer state for {megatron_name(name)}: it is incomplete")
        fp32 = state["param"] if state else weight
        if tuple(fp32.shape) != tuple(weight.shape):
            fail(f"{ckpt.directory}: the optimizer's {megatron_name(name)} has shape {list(fp32.shape)}, the weight "
                 f"{list(weight.shape)}: the checkpoint is damaged")
        zeros = torch.zeros(weight.shape, dtype=torch.float32)
        out[name] = {"fp32": fp32.float().contiguous(),
                     "exp_avg": (state["exp_avg"] if state else zeros).float().contiguous(),
                     "exp_avg_sq": (state["exp_avg_sq"] if state else zeros).float().contiguous()}
    return out


def _write_tag(tag_dir: Path, states: dict, step: int, client: dict) -> dict:
    """The checkpoint's files; returns their manifest (relative path -> size and xxh3)."""
    files = {}
    (tag_dir / CONVERTED).mkdir(parents=True)
    for name, state in states.items():
        # a copy of each: the reader's tensors may be views of an optimizer buffer, which torch.save writes whole
        files[f"{CONVERTED}/{name}.pt"] = save_hashed({k: v.clone() for k, v in state.items()},
                                                      tag_dir / CONVERTED / f"{name}.pt")
    meta = {"step": torch.tensor(float(step)), "extra": {}}
    files[f"{CONVERTED}/_extra_state.pt"] = save_hashed(meta, tag_dir / CONVERTED / "_extra_state.pt")
    (tag_dir / CONVERTED / DONE).write_text("megatron\n")
    files[CLIENT_STATE] = save_hashed(client, tag_dir / CLIENT_STATE)
    files[f"{CONVERTED}/{DONE}"] = digest(tag_dir / CONVERTED / DONE)
    return files


def import_megatron(load, run, iteration: int | None = None, config=None, preset: str | None = None,
                    sets=()) -> dict:
    """Write run directory ``run`` from the Megatron checkpoint ``load`` (``iteration``: default the newest)
    with the run config of ``config`` / ``preset`` / ``sets`` (as ``llmjp-ds train`` takes them). Every check
    runs before anything is written."""
    run_dir = Path(run)
    if run_dir.exists() or run_dir.is_symlink():
        fail(f"{run_dir} already exists: import-megatron writes a new run directory (two runs never share one); "
             "choose another --run")
    cfg = load_config(config, [*sets, f"run_dir={run_dir}"], preset)
    model_config = model_config_of(cfg)
    ckpt = megatron_reader.read(load, iteration)
    check_config(ckpt, cfg, model_config)
    optim = optim_settings(ckpt, cfg.train.steps, BatchSchedule.of(cfg.train))
    states = layout_free_states(ckpt, model_config)
    data = cfg.to_dict()
    data["optim"].update(optim)
    data["model"]["overrides"] = {k: v for k, v in data["model"]["overrides"].items() if v is not None}
    build_config(data)  # the config.yaml written below loads: a mistake here is refused before any write
    a = ckpt.arg
    consumed = consumed_samples(ckpt)
    tp, pp, dp = (int(a(k, 1) or 1) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                               "data_parallel_size"))
    ep = megatron_moe.expert_layout(ckpt.args)[0]
    source = {"load": str(Path(load).resolve()), "iteration": ckpt.iteration, "format": ckpt.fmt,
              "layout": f"TP{tp} x PP{pp} x DP{dp}" + (f" x EP{ep}" if ep > 1 else ""),
              "optimizer_state": ckpt.optimizer is not None,
              "optimizer_step": ckpt.step}
    client = ClientState(train_state={"step": ckpt.iteration, "consumed_samples": consumed},
                         imported_from=source).to_dict()
    tag = _write_run(run_dir, data, cfg, model_config, states, client, ckpt.step, (pp, dp, tp), ckpt.scheduler)
    return {"run_dir": str(run_dir), "tag": tag, "step": ckpt.iteration, "consumed_samples": consumed, **source,
            "optim": optim}


def _write_run(run_dir: Path, data: dict, cfg, model_config, states: dict, client: dict, optimizer_step: int,
               megatron_layout: tuple[int, int, int], scheduler: dict) -> str:
    """The run directory, built beside its place and renamed into it: config.yaml, the checkpoint (its marker
    last), ``latest``. Returns the checkpoint's tag."""
    step = client["train_state"]["step"]
    tag = tag_for(step)
    pp, dp, tp = megatron_layout
    meta = CheckpointMeta.for_run(cfg, model_config, dp)
    meta.pipeline_stages, meta.tensor_parallel, meta.layout_free = pp, tp, True  # Megatron's layout, for the log
    meta.run_config, meta.consumed_samples = data, client["train_state"]["consumed_samples"]
    meta.lr_schedule = dict(scheduler)  # Megatron's own: a resume in check mode holds the config to it
    with atomic_directory(run_dir) as tmp:
        with open(tmp / "config.yaml", "w") as f:
            yaml.safe_dump(data, f, sort_keys=False)
        tag_dir = tmp / "checkpoints" / tag
        files = _write_tag(tag_dir, states, optimizer_step, client)
        (tag_dir / MARKER).write_text(json.dumps({**meta.to_dict(), "step": step, "tag": tag,
                                                  "files": dict(sorted(files.items()))}, indent=1))
        (tmp / "checkpoints" / LATEST).write_text(tag)
    return tag


def cli_main(argv: list[str], verb: str = "import-megatron") -> int:
    p = argparse.ArgumentParser(prog=f"llmjp-ds {verb}", description="continue a Megatron-LM run: its checkpoint "
                                "(weights, optimizer, LR schedule, data position) as a new llmjp-ds run")
    p.add_argument("--load", required=True, help="Megatron-LM's --save directory (or one iter_NNNNNNN directory)")
    p.add_argument("--iteration", type=int, default=None, help="the iteration to import (default: the latest)")
    p.add_argument("--run", required=True, help="run directory to create (must not exist)")
    add_config_args(p, config="run config (YAML or JSON), as llmjp-ds train takes it")
    a = p.parse_args(argv)
    out = import_megatron(a.load, a.run, a.iteration, a.config, a.preset, a.sets)
    state = "with its optimizer state" if out["optimizer_state"] else "without optimizer state (AdamW starts afresh)"
    print(f"imported iteration {out['iteration']} ({out['format']}, {out['layout']}) {state} as {out['tag']} of "
          f"{out['run_dir']} ({out['consumed_samples']} samples consumed; LR {out['optim']['lr']:g}, warmup "
          f"{out['optim']['warmup_steps']}, {out['optim']['decay_style']} decay to step {out['optim']['decay_steps']}, "
          "Megatron's schedule); "
          f"continue with: llmjp-ds train --config {Path(out['run_dir']) / 'config.yaml'}")
    return 0
