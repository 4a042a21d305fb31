"""One training setup, said twice: as Megatron-LM's ``pretrain_gpt.py`` arguments and as ``llmjp-ds train``'s.

Both stacks get the same model shape, the same initial weights (one Megatron release checkpoint and one HF
directory written from the same tensors), the same blend, split, seed and sample counts (``data.order: megatron``
reads the windows through megatron-core's own builder), the same AdamW, clipping and LR schedule
(``optim.schedule: megatron``: Megatron's warm-up from 0) and no z-loss, which Megatron-Core does not have.

:class:`MoE` is the mixture-of-experts check's: ``parity-moe`` (llmjp4-32b-a3b's design, reduced), LLM-jp's router
arguments (the aux_loss load balancing and the router z-loss, router in fp32, dropless), Megatron-Core's fastest
single-GPU MoE path (grouped GEMM, permutation and router fusion, the alltoall dispatcher), and both stacks
recording each expert's tokens every few steps.

:class:`Recipe` is LLM-jp-4's recipe (docs/llmjp4-recipe.md) at the same scale: a stable WSD run whose global batch
grows by Megatron-Core 0.19's ``--step-batch-size-schedule``, and a decay branch from its checkpoint on another blend.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

APEX_STAND_IN = Path(__file__).resolve().parent / "apex"


@dataclass(frozen=True)
class Setup:
    steps: int = 500
    flip: int = 250  # the FP8 runs (delayed scaling, hybrid) start here, from the BF16 checkpoint of this step
    seq_len: int = 4096
    global_batch: int = 2  # sequences a step (micro-batches of one); run AE's continuations ran at 1
    micro_batch: int = 1
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup: int = 50
    eval_interval: int = 100
    eval_iters: int = 2
    seed: int = 1234  # the data's (Megatron's --seed)
    split: str = "990,9,1"
    init_seed: int = 42


@dataclass(frozen=True)
class Recipe:
    """LLM-jp-4's recipe at the parity check's scale, on :class:`Setup`'s model, data, LR and evaluation.

    Megatron-LM core_v0.19 ignores ``--rampup-batch-size`` (megatron/core/num_microbatches_calculator.py: it only
    warns) and refuses ``--global-batch-size`` beside ``--step-batch-size-schedule`` (megatron/training/arguments.py,
    validate_args), whose global batch is then micro-batch x DP, one sequence here. Megatron-LM converts
    ``--*-iters`` to samples by that one sequence (training.py, get_optimizer_param_scheduler), so the runs count
    samples: ``--train-samples``, ``--lr-warmup-samples``, ``--lr-decay-samples``, ``--lr-wsd-decay-samples``. Ours
    says the same with ``train.global_batch_size: 1`` (steps of one sample count the schedule),
    ``train.batch_changes`` from the step schedule, and ``train.steps``: the iterations Megatron-LM's
    ``update_train_iters`` takes to consume ``--train-samples``, whose count is the batches' sum at the last step.
    Every run's minimum LR is the branch's 0: Megatron-Core's distributed optimizer finds a checkpoint's parameter
    groups by their max and min LR (distrib_optimizer.py, load_state_dict), so a branch with another ``--min-lr``
    fails to load its source's optimizer (run AH, a KeyError). The stable run's LR never reaches its minimum.
    """

    steps: int = 140
    branch: int = 40  # W-A1 saves here and exits; W-A2 and the decay branches start from this checkpoint
    # thresholds in tokens, as LLM-jp writes them ("0:512 T:2048"); Megatron-LM divides them by --seq-length:
    # 192,000 tokens are 46 samples, 384,000 are 93, so the batch is 1 for steps 1-46, 2 for 47-70, then 4. The
    # first change comes after the branch step: Megatron-LM saves a checkpoint whenever its number of micro-batches
    # changes and --save is set (training.py, train), and W-A1 is the run that saves; the runs from its checkpoint
    # and W-B cross both changes
    batch_schedule: str = "0:1 192K:2 384K:4"
    warmup_samples: int = 32  # the warm-up ends within the batch of 1
    wsd_decay_style: str = "linear"  # the stable run's (v4-8b-phase1/base/params.sh), over its last step alone
    decay_style: str = "minus_sqrt"  # the branch's decay, over the rest of the run, to an LR of 0
    # the branch's blend: the same three corpora at other weights. Each corpus's samples start from its first
    # again in a new blend, as in a Megatron-LM restart with another --data-path: both stacks reread the same ones
    decay_weights: tuple[float, ...] = (0.2, 0.3, 0.5)

    def batch_changes(self, seq_len: int) -> tuple[tuple[int, int], ...]:
        """``(start_step, batch)`` of the step schedule, as ``llmjp-ds import-megatron`` reads it."""
        from llmjp_ds.data.batch_schedule import changes_at_thresholds, megatron_step_schedule

        return changes_at_thresholds(megatron_step_schedule(self.batch_schedule, seq_len))

    def batches(self, seq_len: int):
        """The batch schedule of the step schedule (its changes at step indices from 0)."""
        from llmjp_ds.data.batch_schedule import BatchSchedule, step_index

        return BatchSchedule(1, None, tuple((step_index(s), b) for s, b in self.batch_changes(seq_len)))

    def consumed(self, step: int, seq_len: int) -> int:
        """The samples steps ``1 .. step`` read."""
        return self.batches(seq_len).consumed_at(step)

    def train_samples(self, seq_len: int) -> int:
        return self.consumed(self.steps, seq_len)

    def warmup_steps(self, seq_len: int) -> int:
        """The steps whose samples make the warm-up's (``optim.warmup_steps``: the config counts steps)."""
        steps = self.batches(seq_len).step_at(self.warmup_samples)
        assert self.consumed(steps, seq_len) == self.warmup_samples, "the warm-up ends inside a step"
        return steps

    def stable_wsd_samples(self, seq_len: int) -> int:
        """The stable run's WSD decay: its last step's samples (LLM-jp's ``--lr-wsd-decay-iters 1``), so its LR
        stays at the peak through the last step."""
        return self.train_samples(seq_len) - self.consumed(self.steps - 1, seq_len)

    def decay_samples(self, seq_len: int) -> int:
        """The branch's WSD decay: every sample after the branch point."""
        return self.train_samples(seq_len) - self.consumed(self.branch, seq_len)


@dataclass(frozen=True)
class MoE:
    """The MoE check: ``shape`` over :attr:`setup` (300 steps of four sequences of 2048, FP8 from step 151), the
    router's losses as LLM-jp's MoE runs weigh them (the llmjp4-32b-a3b preset's), and the steps between the
    per-expert loads both stacks record (ours' ``logging.expert_load_interval``; Megatron-LM core_v0.19's
    ``--save-tokens-per-expert-interval``, which writes ``SAVE/tokens_per_expert/rank0.jsonl`` from the forward
    hooks of megatron/training/activation_logging.py and so needs ``--save``)."""

    shape: str = "parity-moe"
    setup: Setup = Setup(steps=300, flip=150, seq_len=2048, global_batch=4)
    aux_loss_coeff: float = 1e-2
    z_loss_coeff: float = 1e-3
    load_interval: int = 10

    def megatron_args(self) -> list[str]:
        """The router and the MoE kernels as LLM-jp's MoE runs pass them (the shape's flags are
        :func:`_shape_args`'). ``--moe-per-layer-logging`` writes each layer's losses to TensorBoard and W&B only
        (neither is set here): the log line carries their mean over the layers."""
        return ["--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", str(self.aux_loss_coeff),
                "--moe-z-loss-coeff", str(self.z_loss_coeff), "--moe-router-dtype", "fp32",
                "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm", "--moe-permute-fusion",
                "--moe-router-fusion", "--moe-per-layer-logging"]

    def ours(self) -> dict:
        """Our ``--set``s of the same (the router in fp32 and dropless routing are ours' only way)."""
        return {"model.shape": self.shape, "model.moe_aux_loss": "aux_loss",
                "model.moe_aux_loss_coeff": self.aux_loss_coeff, "model.moe_z_loss_coeff": self.z_loss_coeff,
                "logging.expert_load_interval": self.load_interval}


def megatron_env(env=None) -> dict:
    """The environment ``pretrain_gpt.py`` runs in: apex's weight-gradient kernel stood in for, and one CUDA
    connection (Megatron-LM's requirement for ordering its communication before its GEMMs)."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(APEX_STAND_IN), env.get("PYTHONPATH")) if p)
    env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    return env


def _shape_args(config) -> list[str]:
    from llmjp_ds.model.shapes import has_qk_norm, is_moe_layer, rope_theta

    heads, groups = config.num_attention_heads, config.num_key_value_heads
    extra = ["--group-query-attention", "--num-query-groups", str(groups)] if groups != heads else []
    if has_qk_norm(config):
        extra.append("--qk-layernorm")
    if getattr(config, "num_experts", 0):  # every layer MoE but the dense ones, as Megatron's --moe-layer-freq list
        pattern = [int(is_moe_layer(config, i)) for i in range(config.num_hidden_layers)]
        extra += ["--num-experts", str(config.num_experts), "--moe-router-topk", str(config.num_experts_per_tok),
                "--moe-ffn-hidden-size", str(config.moe_intermediate_size),
                *(["--moe-layer-freq", str(pattern).replace(" ", "")] if 0 in pattern else [])]
    return ["--num-layers", str(config.num_hidden_layers), "--hidden-size", str(config.hidden_size),
            "--ffn-hidden-size", str(config.intermediate_size), "--num-attention-heads", str(heads), *extra,
            "--kv-channels", str(config.head_dim), "--normalization", "RMSNorm",
            "--norm-epsilon", str(config.rms_norm_eps), "--swiglu", "--untie-embeddings-and-output-weights",
            "--disable-bias-linear", "--position-embedding-type", "rope",
            "--rotary-base", str(int(rope_theta(config))),
            "--attention-dropout", "0", "--hidden-dropout", "0", "--init-method-std", "0.02"]


def _schedule_args(setup: Setup, recipe: Recipe | None, decay: bool) -> list[str]:
    """The global batch, the run's length and the LR schedule: :class:`Setup`'s in iterations, or the recipe's in
    samples (its stable run; ``decay``: its branch, which overrides the checkpoint's schedule as LLM-jp's decay
    restarts do)."""
    s = setup
    if recipe is None:
        return ["--global-batch-size", str(s.global_batch), "--train-iters", str(s.steps), "--lr", str(s.lr),
                "--min-lr", str(s.min_lr), "--lr-decay-style", "cosine", "--lr-warmup-iters", str(s.warmup),
                "--lr-decay-iters", str(s.steps)]
    samples = recipe.train_samples(s.seq_len)
    if decay:
        wsd = ["--override-opt_param-scheduler", "--lr-wsd-decay-style", recipe.decay_style,
               "--lr-wsd-decay-samples", str(recipe.decay_samples(s.seq_len))]
    else:
        wsd = ["--lr-wsd-decay-style", recipe.wsd_decay_style,
               "--lr-wsd-decay-samples", str(recipe.stable_wsd_samples(s.seq_len))]
    return ["--step-batch-size-schedule", recipe.batch_schedule, "--train-samples", str(samples), "--lr", str(s.lr),
            "--min-lr", "0", "--lr-decay-style", "WSD", "--lr-warmup-samples", str(recipe.warmup_samples),
            "--lr-decay-samples", str(samples), *wsd]


def megatron_args(setup: Setup, config, blend: list[tuple[float, str]], tokenizer: str, cache: str,
                  load: str, finetune: bool = False, save: str | None = None, exit_at: int | None = None,
                  fp8: bool = False, recipe: Recipe | None = None, decay: bool = False,
                  moe: MoE | None = None) -> list[str]:
    """``pretrain_gpt.py`` arguments (Megatron-LM core_v0.19). ``load`` with ``finetune``: the initial weights
    only (iteration 0, no optimizer); without: a resume. ``save`` with ``exit_at``: save there and stop. The
    weight gradients accumulate in fp32 inside the GEMMs (Megatron's default), as ours do: its own linear layer
    (the head) needs apex's kernel, which benchmarks/parity/apex/ stands in for. ``recipe``: its batches and
    schedule in samples, ``decay`` its branch's (``blend``: the branch's own). ``moe``: an MoE ``config``'s router
    and kernels (:class:`MoE`)."""
    s = setup
    args = [*_shape_args(config),
            "--seq-length", str(s.seq_len), "--max-position-embeddings", str(s.seq_len),
            "--micro-batch-size", str(s.micro_batch), *_schedule_args(s, recipe, decay), "--weight-decay", "0.1",
            "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--adam-eps", "1e-8", "--clip-grad", "1.0",
            "--bf16", "--use-distributed-optimizer", "--transformer-impl", "transformer_engine",
            "--attention-softmax-in-fp32",
            "--no-create-attention-mask-in-dataloader",
            "--data-path", *[str(x) for w, p in blend for x in (w, p)], "--split", s.split, "--seed", str(s.seed),
            "--data-cache-path", cache, "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", tokenizer,
            "--log-interval", "1", "--eval-interval", str(s.eval_interval), "--eval-iters", str(s.eval_iters),
            "--load", load, "--ckpt-format", "torch_dist", *(moe.megatron_args() if moe else [])]
    if finetune:
        args += ["--finetune", "--no-load-optim", "--no-load-rng"]
    if save:
        args += ["--save", save, "--save-interval", str(exit_at or s.steps)]
    if exit_at:
        args += ["--exit-interval", str(exit_at)]
    if fp8:  # LLM-jp's FP8 settings (LLMJP.md); Megatron-LM flips by a restart with these flags
        args += ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "1",
                 "--fp8-amax-compute-algo", "most_recent"]
    return args


def _blend_value(blend: list[tuple[float, str]]) -> str:
    return "[" + ", ".join(f"{w}, {p}" for w, p in blend) + "]"


def ours_sets(setup: Setup, blend: list[tuple[float, str]], tokenizer: str, cache: str, init_hf: str | None,
              fp8_from: int | None = None, recipe: Recipe | None = None, moe: MoE | None = None) -> list[str]:
    """``llmjp-ds train --preset llmjp3-1.8b`` overrides for the same setup; ``fp8_from``: the step whose
    checkpoint the FP8 phase starts from, as Megatron's restart (delayed scaling, hybrid, LLM-jp's amax settings, no
    calibration: the restart has none either); ``recipe``: its stable run, whose step counts the LR schedule turns
    into the samples its batches read, as Megatron's sample-based arguments give them; ``moe``: its shape and
    router (:class:`MoE`)."""
    s = setup
    sets = {"data.blend": _blend_value(blend), "data.tokenizer": tokenizer,
            "data.order": "megatron", "data.split": "[" + s.split + "]", "data.seed": s.seed,
            "data.seq_len": s.seq_len, "data.cache_dir": cache, "model.z_loss": 0,
            "train.steps": s.steps, "train.global_batch_size": s.global_batch,
            "train.micro_batch_size": s.micro_batch, "train.eval_interval": s.eval_interval,
            "train.eval_batches": s.eval_iters, "optim.lr": s.lr, "optim.min_lr": s.min_lr,
            "optim.warmup_steps": s.warmup, "optim.decay_steps": s.steps, "optim.schedule": "megatron",
            "checkpoint.interval": 0, "checkpoint.save_at_end": "false", "checkpoint.async_save": "false",
            "logging.wandb": "disabled"}
    if recipe is not None:
        changes = ", ".join(f"{{start_step: {step}, global_batch_size: {batch}}}"
                            for step, batch in recipe.batch_changes(s.seq_len))
        sets.update({"train.steps": recipe.steps, "train.global_batch_size": 1, "train.batch_changes": f"[{changes}]",
                     "optim.warmup_steps": recipe.warmup_steps(s.seq_len), "optim.decay_steps": recipe.steps,
                     "optim.min_lr": 0, "optim.decay_style": "WSD",
                     "optim.wsd_decay_style": recipe.wsd_decay_style, "optim.wsd_decay_steps": 1})
    if moe is not None:
        sets.update(moe.ours())
    if init_hf:
        sets["model.init_from_hf"] = init_hf
    if fp8_from is not None:
        sets["precision.phases"] = (
            f"[{{precision: bf16}}, {{precision: fp8, start_step: {fp8_from + 1}, recipe: delayed, fp8_format: hybrid, "
            "amax_history_len: 1, amax_compute_algo: most_recent, calibration_steps: 0}]")
    return [x for key, value in sets.items() for x in ("--set", f"{key}={value}")]


def branch_sets(setup: Setup, recipe: Recipe, blend: list[tuple[float, str]]) -> list[str]:
    """``llmjp-ds branch`` overrides of the recipe's decay branch, as D1's arguments change W-A1's: the WSD decay
    over the rest of the run, to an LR of 0, and the other blend (a data phase from the branch's step). The branch
    follows its own schedule from its first step (``optim.resume_schedule: override``, the branch's default)."""
    sets = {"optim.min_lr": 0, "optim.wsd_decay_style": recipe.decay_style,
            "optim.wsd_decay_steps": recipe.steps - recipe.branch, "data.blend": _blend_value(blend)}
    return [x for key, value in sets.items() for x in ("--set", f"{key}={value}")]
