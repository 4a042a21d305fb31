"""Quantities derived from a run config: the samples it reads, its model's config and sequence length, sequence
parallelism, its stop signals, and which steps it saves. Pure functions of the config."""

from __future__ import annotations

import signal

from llmjp_ds.data.batch_schedule import BatchSchedule
from llmjp_ds.config.schema import CheckpointConfig, KeepRule, RunConfig
from llmjp_ds.errors import did_you_mean, fail
from llmjp_ds.model.options import ModelOptions
from llmjp_ds.model.shapes import model_config, overrides_dict


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
    return BatchSchedule.of(cfg.train).consumed_at(cfg.train.steps)


def megatron_sample_counts(cfg: RunConfig) -> tuple[int, int, int]:
    """(train, valid, test) sizes Megatron-LM asks its dataset builder for (``get_train_valid_test_num_samples``
    in megatron/training/training.py): ``train_iters * gbs`` (:func:`train_samples`), ``(train_iters //
    eval_interval + 1) * eval_iters * gbs`` (its evaluations never restart the validation iterator, and one more
    follows the last step) and
    ``eval_iters * gbs``, with train_iters = ``train.steps`` and eval_iters = ``train.eval_batches`` (at least 1,
    as our validation reads); no validation (``eval_interval`` 0) is eval_iters 0."""
    t = cfg.train
    eval_iters = max(1, t.eval_batches) if t.eval_interval else 0
    valid = (t.steps // t.eval_interval + 1) * eval_iters if t.eval_interval else 0
    return train_samples(cfg), valid * t.global_batch_size, eval_iters * t.global_batch_size


def blend_history(cfg: RunConfig, until_step: int) -> list[list]:
    """``[start_step, blend, count]`` of each data phase that governs one of the first ``until_step`` steps
    (data.blend's as step 1's): two configs with the same history gave those steps the same samples' blends."""
    phases = [[1, [str(x) for x in cfg.data.blend], "run"]]
    phases += [[p.start_step, [str(x) for x in p.blend], p.count] for p in cfg.data.phases
               if p.start_step <= until_step]
    return phases


def model_config_of(cfg: RunConfig):
    """The transformers config of the run's model shape with its overrides (``LlamaConfig``, or ``Qwen3Config`` /
    ``Qwen3MoeConfig``), initialised with ``model.init_std``; an MoE's with the run's load-balancing coefficient
    (what an export's ``router_aux_loss_coef`` says)."""
    config = model_config(cfg.model.shape, **overrides_dict(cfg.model.overrides))
    config.initializer_range = cfg.model.init_std
    if getattr(config, "num_experts", None):
        config.router_aux_loss_coef = cfg.model.moe_aux_loss_coeff
    return config


def model_options_of(cfg: RunConfig) -> ModelOptions:
    """The options the run's model is built with (``model.*``)."""
    m = cfg.model
    return ModelOptions(recompute=m.recompute, fused_qkv_rope=m.fused_qkv_rope, attention_core=m.attention_core,
                        fused_residual_norm=m.fused_residual_norm, moe_aux_loss=m.moe_aux_loss,
                        moe_aux_loss_coeff=m.moe_aux_loss_coeff, moe_z_loss_coeff=m.moe_z_loss_coeff,
                        moe_capacity_factor=m.moe_capacity_factor, moe_drop_policy=m.moe_drop_policy)


def seq_len_of(cfg: RunConfig, model_config) -> int:
    return cfg.data.seq_len or model_config.max_position_embeddings


def sequence_parallel_of(cfg: RunConfig) -> bool:
    """Sequence parallelism is on with tensor parallelism unless the config turns it off (and off without it)."""
    sp = cfg.parallel.sequence_parallel
    return cfg.parallel.tensor_parallel > 1 and (sp is None or sp)


# the interpreter's or the kernel's own signals: a handler of these would stop the run on a fault or a child's exit
NOT_STOP_SIGNALS = ("SIGCHLD", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT", "SIGTRAP", "SIGSYS", "SIGXFSZ")


def stop_signals_of(cfg: RunConfig) -> tuple:
    """``checkpoint.stop_signals`` as ``signal.Signals`` (a name with or without ``SIG``, any case), each once;
    one line naming the item that cannot be a stop signal."""
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
