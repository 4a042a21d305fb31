"""The parity check's MoE mode (``python -m benchmarks.parity --moe``, benchmarks/parity/moe.py), without a GPU or
Megatron-LM: its Megatron-LM command lines read as Megatron-LM core_v0.19 reads them and ours read by llmjp_ds's own
config loader say the same model, router, batches, LR and FP8 flip to both stacks; the plan of its eight runs fits
one device call; the release checkpoint of its initial weights keeps the extra state of an MoE layer's modules; and
its report, on stood-in runs that print what Megatron-LM prints and write what ours writes, gives the rows (a gap
over the spread, or the last 10 steps off by more than 0.3 %, fails its row)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest

from benchmarks.parity import __main__ as harness
from benchmarks.parity import moe
from llmjp_ds.config import load_config
from tests.test_parity_report import (CORPORA, MLM, megatron_lrs, megatron_reads, ours_lrs, pretrain_args, rows,
                                      sets_of)

WORK = Path("/w")


def moe_commands(setup=None) -> dict[str, list[str]]:
    made = moe.moe_jobs(setup or moe.MOE.setup, WORK, WORK / "runs", MLM, CORPORA, "/w/t.model")
    return {job.name: job.cmd for job in made}


def moe_reads(argv: list[str]) -> argparse.Namespace:
    """``argv`` as Megatron-LM core_v0.19 reads it: :func:`megatron_reads`'s flags, and the model's, the router's,
    FP8's and the saves' as its parser declares them (training/arguments.py: ``--num-experts``,
    ``--moe-router-load-balancing-type`` and ``--moe-aux-loss-coeff`` in _add_moe_args, ``--no-save-optim`` and
    ``--no-save-rng`` in _add_checkpointing_args; TransformerConfig's and TrainingConfig's fields through
    ArgumentGroupFactory: ``Literal`` choices, booleans ``store_true``), then validate_args's MoE steps (a list of
    one load-balancing type or coefficient is the value itself)."""
    p = argparse.ArgumentParser(allow_abbrev=False)
    for flag in ("--num-experts", "--moe-ffn-hidden-size", "--save-tokens-per-expert-interval"):
        p.add_argument(flag, type=int)
    p.add_argument("--moe-router-topk", type=int, default=2)
    p.add_argument("--moe-router-load-balancing-type", nargs="+", default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "quantile_balancing", "none"])
    p.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=0.0)
    p.add_argument("--moe-z-loss-coeff", type=float)
    p.add_argument("--moe-router-dtype", choices=["fp32", "fp64"])
    p.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall", "flex"], default="allgather")
    p.add_argument("--moe-layer-freq", default=1)
    p.add_argument("--moe-expert-capacity-factor", type=float)
    p.add_argument("--fp8-format", dest="fp8", choices=["e4m3", "hybrid"])
    p.add_argument("--fp8-recipe", choices=["tensorwise", "delayed", "mxfp8", "blockwise", "custom"], default="delayed")
    p.add_argument("--fp8-amax-history-len", type=int, default=1)
    p.add_argument("--fp8-amax-compute-algo", choices=["most_recent", "max"], default="most_recent")
    for flag in ("--qk-layernorm", "--moe-grouped-gemm", "--moe-permute-fusion", "--moe-router-fusion",
                 "--moe-per-layer-logging", "--no-save-optim", "--no-save-rng", "--bf16"):
        p.add_argument(flag, action="store_true")
    for flag in ("--split", "--tokenizer-model"):
        p.add_argument(flag)
    p.add_argument("--seed", type=int, default=1234)
    a, _ = p.parse_known_args(argv)
    for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        value = getattr(a, name)
        if isinstance(value, list) and len(value) == 1:
            setattr(a, name, value[0])
    return argparse.Namespace(**vars(megatron_reads(argv)), **vars(a))


def ours_config(cmd: list[str]):
    return load_config(None, sets_of(cmd), cmd[cmd.index("--preset") + 1])


def megatron_iteration_lrs(a) -> list[float]:
    """Each iteration's LR as get_optimizer_param_scheduler (training.py) schedules iteration-based training: the
    warm-up and decay in samples, ``--lr-*-iters`` times the global batch, stepped by the batch."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class Optimizer:
        param_groups = [{"wd_mult": 1.0}]

    gbs = a.global_batch_size
    sched = OptimizerParamScheduler(
        Optimizer(), init_lr=a.lr_warmup_init, max_lr=a.lr, min_lr=a.min_lr, lr_warmup_steps=a.lr_warmup_iters * gbs,
        lr_decay_steps=(a.lr_decay_iters or a.train_iters) * gbs, lr_decay_style=a.lr_decay_style,
        start_wd=a.start_weight_decay, end_wd=a.end_weight_decay, wd_incr_steps=a.train_iters * gbs,
        wd_incr_style=a.weight_decay_incr_style, use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=False, wsd_decay_steps=None, lr_wsd_decay_style=a.lr_wsd_decay_style)
    return megatron_lrs(sched, Optimizer.param_groups[0], [gbs] * a.train_iters)


def moe_disagreements(commands: dict[str, list[str]]) -> list[str]:
    """What the MoE check's Megatron runs and ours read differently, each entry naming it."""
    from llmjp_ds.config import megatron_sample_counts, model_config_of
    from llmjp_ds.model.shapes import rope_theta

    out = []
    runs = {name: moe_reads(pretrain_args(cmd)) for name, cmd in commands.items() if name.startswith("M-")}
    ours, ours_fp8 = ours_config(commands["ours-moe"]), ours_config(commands["ours-moe-fp8"])
    a1, fa = runs["M-A1"], runs["M-FA"]
    c, m = model_config_of(ours), ours.model
    shape = (a1.num_layers, a1.hidden_size, a1.num_attention_heads, a1.num_query_groups, a1.kv_channels,
             a1.num_experts, a1.moe_router_topk, a1.moe_ffn_hidden_size, a1.qk_layernorm, a1.rotary_base,
             a1.layernorm_epsilon, a1.moe_layer_freq)
    if shape != (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                 c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, True, rope_theta(c), c.rms_norm_eps,
                 1 if not c.mlp_only_layers else "dense layers"):
        out.append("the model's shape")
    router = (a1.moe_router_load_balancing_type, a1.moe_aux_loss_coeff, a1.moe_z_loss_coeff,
              a1.moe_expert_capacity_factor, a1.moe_router_dtype)
    if router != (m.moe_aux_loss, m.moe_aux_loss_coeff, m.moe_z_loss_coeff, m.moe_capacity_factor, "fp32") \
            or m.z_loss != 0:
        out.append("the router's losses")
    own = ("load", "save", "finetune", "exit_interval", "save_interval", "fp8", "no_save_optim", "no_save_rng",
           "save_tokens_per_expert_interval", "moe_permute_fusion", "moe_router_fusion")  # what sets a process
    # apart: its start, save, precision, loads, and (B's) Megatron's MoE fusions
    def besides_precision(cfg):
        data = cfg.to_dict()
        data.pop("precision"), data.pop("run_dir"), data["data"].pop("cache_dir")
        return data

    if any({**vars(r), **{k: getattr(a1, k) for k in own}} != vars(a1) for r in runs.values()) \
            or besides_precision(ours_fp8) != besides_precision(ours):
        out.append("the runs' settings besides their loads, saves and precision")
    fused = {n: (r.moe_permute_fusion, r.moe_router_fusion) for n, r in runs.items()}
    if not (a1.moe_grouped_gemm and a1.moe_token_dispatcher_type == "alltoall") or fused != {
            n: (False, False) if n in moe.UNFUSED else (True, True) for n in runs}:
        out.append("Megatron-Core's MoE kernels")  # fused as LLM-jp runs them; B's unfused (its spread)
    t = ours.train
    if (a1.train_iters, a1.global_batch_size, a1.micro_batch_size, a1.seq_length, a1.eval_interval, a1.eval_iters) \
            != (t.steps, t.global_batch_size, t.micro_batch_size, ours.data.seq_len, t.eval_interval, t.eval_batches):
        out.append("the run's length and batches")
    blend = [x for w, p in zip(a1.data_path[::2], a1.data_path[1::2]) for x in (float(w), p)]
    if (blend, a1.seed, [float(x) for x in a1.split.split(",")]) != (ours.data.blend, ours.data.seed,
                                                                      [float(x) for x in ours.data.split]) \
            or ours.data.order != "megatron" or a1.tokenizer_model != ours.data.tokenizer:
        out.append("the data")
    gbs = a1.global_batch_size
    valid = (a1.train_iters // a1.eval_interval + 1) * a1.eval_iters * gbs
    if megatron_sample_counts(ours) != (a1.train_iters * gbs, valid, a1.eval_iters * gbs):
        out.append("the datasets' sizes")
    if ours_lrs(ours, 0) != pytest.approx(megatron_iteration_lrs(a1), rel=1e-12, abs=1e-18):
        out.append("the LR of each step")
    phases = [(p.precision, p.start_step, p.recipe, p.fp8_format, p.amax_history_len, p.amax_compute_algo,
               p.calibration_steps) for p in ours_fp8.precision.phases]
    flip = a1.exit_interval
    if [p[:2] for p in phases] != [("bf16", 1), ("fp8", flip + 1)] or phases[1][2:] != (
            fa.fp8_recipe, fa.fp8, fa.fp8_amax_history_len, fa.fp8_amax_compute_algo, 0) \
            or {n for n, r in runs.items() if r.fp8} != {"M-FA", "M-FB", "M-FAu"}:
        out.append("the FP8 flip")
    # the FP8 half from A's checkpoint: Megatron's unfused restart of it, and ours importing it and continuing in FP8
    # with the flip's phases (the import's run config, then the continuation's own settings on it)
    load, cont = commands["import-moe"], commands["ours-moe-fp8-a"]
    imported = ours_config(load)
    continued = load_config(None, sets_of(load) + sets_of(cont), load[load.index("--preset") + 1])
    run = load[load.index("--run") + 1]

    def besides_start(cfg):
        data = besides_precision(cfg)
        data["model"].pop("init_from_hf")
        return data

    if besides_start(imported) != besides_start(ours) or load[load.index("--load") + 1] != a1.save \
            or runs["M-FAu"].load != a1.save or cont[cont.index("--config") + 1] != f"{run}/config.yaml" \
            or f"run_dir={run}" not in sets_of(cont) or continued.precision != ours_fp8.precision \
            or imported.precision.phases[1:]:
        out.append("the FP8 half from A's checkpoint")
    for x in "AB":  # the continuation and the FP8 half load the first half's checkpoint; the loads in every BF16 run
        first, second, fp8 = runs[f"M-{x}1"], runs[f"M-{x}2"], runs[f"M-F{x}"]
        if not (first.finetune and first.load == str(WORK / "init-moe-megatron") and first.save == second.load
                == fp8.load and first.exit_interval == first.save_interval == flip and second.save != first.save
                and not second.finetune and not fp8.finetune and not any(r.no_save_optim for r in (first, second))):
            out.append(f"M-{x}'s checkpoint")
        if any(r.save_tokens_per_expert_interval != ours.logging.expert_load_interval or not r.save
               for r in (first, second)) or fp8.save_tokens_per_expert_interval is not None:
            out.append(f"M-{x}'s per-expert loads")
    return out


def test_the_moe_runs_say_the_same_to_both_stacks():
    commands = moe_commands()
    assert moe_disagreements(commands) == []
    a1 = moe_reads(pretrain_args(commands["M-A1"]))
    assert (a1.num_experts, a1.moe_router_topk, a1.moe_aux_loss_coeff, a1.moe_z_loss_coeff) == (32, 8, 1e-2, 1e-3)
    assert (a1.train_iters, a1.exit_interval, a1.global_batch_size, a1.seq_length) == (300, 150, 4, 2048)
    assert "--moe-per-layer-logging" in commands["M-A1"] and "--qk-layernorm" in commands["M-FB"]
    assert moe_disagreements(moe_commands(dataclasses.replace(moe.MOE.setup, steps=200, flip=100))) == []


@pytest.mark.parametrize("name, change, names", [
    ("ours-moe", ["--set", "model.moe_z_loss_coeff=0.01"], "the router's losses"),
    ("ours-moe", ["--set", "model.moe_capacity_factor=1.25"], "the router's losses"),
    ("ours-moe", ["--set", "model.overrides.num_experts=64"], "the model's shape"),
    ("M-A1", ["--moe-router-topk", "4"], "the model's shape"),
    ("M-B2", ["--moe-router-topk", "4"], "the runs' settings"),
    ("ours-moe", ["--set", "optim.warmup_steps=49"], "the LR of each step"),
    ("ours-moe", ["--set", "logging.expert_load_interval=20"], "M-A's per-expert loads"),
    ("ours-moe-fp8", ["--set", "precision.phases=[{precision: bf16}, {precision: fp8, start_step: 150}]"],
     "the FP8 flip"),
    ("M-FB", ["--load", "/w/megatron-moe-a"], "M-B's checkpoint"),
    ("M-A2", ["--no-save-optim"], "M-A's checkpoint"),  # Megatron then loads no optimizer either: the resume fails
    ("M-B1", ["--moe-router-fusion"], "Megatron-Core's MoE kernels"),
    ("M-FAu", ["--moe-router-fusion"], "Megatron-Core's MoE kernels"),
    ("M-FAu", ["--load", "/w/megatron-moe-b"], "the FP8 half from A's checkpoint"),
    ("import-moe", ["--set", "model.moe_aux_loss_coeff=0.001"], "the FP8 half from A's checkpoint"),
    ("ours-moe-fp8-a", ["--set", "precision.phases=[{precision: bf16}, {precision: fp8, start_step: 150}]"],
     "the FP8 half from A's checkpoint"),
])
def test_an_moe_run_that_says_otherwise_is_caught(name, change, names):
    commands = moe_commands()
    commands[name] = [*commands[name], *change]
    assert any(d.startswith(names) for d in moe_disagreements(commands))


def test_each_call_of_the_moe_plan_fits_one_device_call():
    """The first call's eight runs: A's and B's first halves and both of ours from the initial weights, each second
    half and FP8 half after its first half; the second call's: A's first half, then its FP8 restarts and our import
    of its checkpoint, our FP8 half after the import. The runs that share the GPU at once fit the H200 beside each
    other, and the longest chain ends within the budget a 570 s call leaves (parity.sh: 30 s less, and ~90 s to
    prepare the blend and the initial weights). Without --only, --moe runs the first call's."""
    made = moe.moe_jobs(moe.MOE.setup, WORK, WORK / "runs", MLM, CORPORA, "/w/t.model")
    after = {job.name: job.after for job in made}
    assert after == {"M-A1": (), "M-B1": (), "ours-moe": (), "ours-moe-fp8": (), "M-A2": ("M-A1",),
                     "M-FA": ("M-A1",), "M-B2": ("M-B1",), "M-FB": ("M-B1",), "M-FAu": ("M-A1",),
                     "import-moe": ("M-A1",), "ours-moe-fp8-a": ("import-moe",)}
    assert set(moe.CALLS[0]) | set(moe.CALLS[1]) == set(after) and all(
        d in call for call in moe.CALLS for n in call for d in after[n])
    est = {job.name: job.estimate_s for job in made}
    assert max(est["M-A1"] + max(est["M-A2"], est["M-FA"]), est["ours-moe"], est["ours-moe-fp8"]) + 90 <= 540
    assert est["M-A1"] + max(est["M-FA"], est["M-FAu"], est["import-moe"] + est["ours-moe-fp8-a"]) + 90 <= 540
    gib = {job.name: job.gib for job in made}
    assert sum(gib[n] for n in ("M-A2", "M-FA", "M-B2", "M-FB", "ours-moe", "ours-moe-fp8")) <= 132
    assert sum(gib[n] for n in moe.CALLS[1]) <= 132
    processes = {p for _, parts in moe.MEGATRON_RUNS for p in parts}
    assert processes == {n for n in after if n.startswith("M-")}
    assert set(moe.OURS_RUNS) == set(after) - processes - {"import-moe"}
    assert all(["rm", "-rf", str(WORK / moe.SAVES[n])] in job.before for job in made for n in (job.name,)
               if n in moe.SAVES)


def test_the_initial_checkpoint_keeps_an_moe_layers_extra_state(tmp_path):
    """Megatron-Core 0.19's TE spec: an MoE layer has TE's RMSNorm before its experts, their two grouped GEMMs and
    no fused LayerNormMLP; qk-norm adds two RMSNorms; a dense layer of the same model keeps its fused MLP's."""
    import torch

    from benchmarks.parity.init import write_megatron_release
    from llmjp_ds.model.shapes import model_config

    config = model_config("parity-moe", num_layers=2, dense_layers=[1])
    path = write_megatron_release({"embedding.word_embeddings.weight": torch.zeros(2)}, config, tmp_path)
    saved = torch.load(path, weights_only=False)
    extra = {k.removesuffix("._extra_state") for k, v in saved["model"].items() if k.endswith("_extra_state")}
    attention = {f"self_attention.{m}" for m in ("linear_qkv", "core_attention", "linear_proj", "q_layernorm",
                                                  "k_layernorm")}
    assert extra == {f"decoder.layers.0.{m}" for m in {*attention, "pre_mlp_layernorm", "mlp.experts.linear_fc1",
                                                       "mlp.experts.linear_fc2"}} | \
        {f"decoder.layers.1.{m}" for m in {*attention, "mlp.linear_fc1", "mlp.linear_fc2"}} | \
        {"decoder.final_layernorm", "output_layer"}
    assert saved["iteration"] == 0 and (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "release"


@pytest.mark.parametrize("shape", ["tiny-moe", "tiny"])
def test_each_module_with_extra_state_is_one_the_initial_weights_name(shape, tmp_path):
    """The release checkpoint of our initial weights (benchmarks/parity/init.py, the names
    interchange/megatron_adapter.to_megatron_state_dict gives them): every module it keeps extra state for holds a
    weight there (but the attention core, which has none), and every module holding a weight but the router and
    the embedding keeps it: so Megatron-LM's strict load can match its state dict."""
    import torch

    from benchmarks.parity.init import write_megatron_release
    from llmjp_ds.interchange.megatron_adapter import to_megatron_state_dict
    from llmjp_ds.model import LlamaForCausalLM
    from llmjp_ds.model.shapes import model_config

    config = model_config(shape, num_layers=2)
    model = LlamaForCausalLM(config, backend="torch")
    state = to_megatron_state_dict({k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")},
                                   config)
    saved = torch.load(write_megatron_release(state, config, tmp_path), weights_only=False)["model"]
    extra = {k.removesuffix("._extra_state") for k in saved if k.endswith("._extra_state")}
    holding = {k.rsplit(".", 1)[0] for k in saved if not k.endswith("_extra_state")}
    assert {m for m in extra if not m.endswith("core_attention")} == \
        {m for m in holding if not m.endswith(("mlp.router", "word_embeddings"))}
    assert len(extra) == 2 * (8 if shape == "tiny-moe" else 5) + 2


# --- the report, on stood-in runs -------------------------------------------------------------------------------
# losses on a grid of 1/32 in [4, 9], which Megatron's %E lines carry exactly, and the mean of two too (a process's
# second line); the spreads (B against A, FB against FA) 1/32 off on every odd step, ours on every fourth; the
# load-balancing loss the LM loss less 1, the z-loss twice it. The loads: each layer's 32 experts get 64, 80, ..,
# 176 tokens in turn, B's turned by one expert at every recorded step, ours' at every second

def stood_in(off: int = 0, tail_off: int = 0) -> dict[str, dict[int, dict]]:
    """Each MoE run's values at each step; ours ``off``/32 more on every step and ``tail_off``/32 more on the last
    10."""
    setup = moe.MOE.setup

    def run(steps, shift, turn, ours=False):
        out = {}
        for s in steps:
            units = round((4 + 5 * math.exp(-s / 60)) * 32) + shift(s)
            units += (off + (tail_off if s > setup.steps - 10 else 0)) if ours else 0
            loss = units / 32
            load = [[64 + (e + turn(s)) % 8 * 16 for e in range(32)] for _ in range(8)]
            out[s] = {"loss": loss, "moe_aux_loss": loss - 1, "moe_z_loss": 2 * loss, "load": load}
        return out

    whole, half = range(1, setup.steps + 1), range(setup.flip + 1, setup.steps + 1)
    none, odd, fourth = (lambda s: 0), (lambda s: s % 2), (lambda s: int(s % 4 == 1))
    return {"megatron-moe-a": run(whole, none, none), "megatron-moe-b": run(whole, odd, lambda s: 1),
            "ours-moe": run(whole, fourth, lambda s: int(s % 20 == 0), ours=True),
            "megatron-moe-fa": run(half, none, none), "megatron-moe-fb": run(half, odd, lambda s: 1),
            "ours-moe-fp8": run(half, fourth, lambda s: int(s % 20 == 0), ours=True),
            "megatron-moe-fau": run(half, odd, lambda s: 1),
            "ours-moe-fp8-a": run(half, fourth, lambda s: int(s % 20 == 0), ours=True)}


# each Megatron process's curve and the steps it runs (None: all of its curve's)
PROCESSES = {"M-A1": ("megatron-moe-a", True), "M-A2": ("megatron-moe-a", False), "M-B1": ("megatron-moe-b", True),
             "M-B2": ("megatron-moe-b", False), "M-FA": ("megatron-moe-fa", None), "M-FB": ("megatron-moe-fb", None),
             "M-FAu": ("megatron-moe-fau", None)}


def stood_in_moe(real, values, fail=()):
    """``moe_jobs`` with each run's command replaced by a process that prints its Megatron lines (the second line
    of each process the mean of its first two, as Megatron-Core 0.19 prints it) and appends its loads where the real
    command's ``--save`` is (the odd experts' in one micro-batch, the even ones' in the other), or writes our
    metrics.jsonl."""
    def prints(curve, save):
        first, lines = min(curve), []
        for s, v in curve.items():
            v = {k: (v[k] + curve[first][k]) / 2 for k in KEYS} if s == first + 1 else v
            lines.append(f" [t] iteration {s:8d}/     300 | consumed samples: {4 * s} | learning rate: 3.000000E-04 |"
                         f" lm loss: {v['loss']:E} | load_balancing_loss: {v['moe_aux_loss']:E} | z_loss: "
                         f"{v['moe_z_loss']:E} | loss scale: 1.0 | grad norm: 1.000 |")
        records = "".join(json.dumps({"iter": s, "block": "decoder", "layer": i,
                                      "tpe": [[n * (e % 2) for e, n in enumerate(layer)],
                                              [n * (1 - e % 2) for e, n in enumerate(layer)]]}) + "\n"
                          for s, v in curve.items() if s % 10 == 0 for i, layer in enumerate(v["load"]))
        code = ("import os, sys; print('\\n'.join(sys.argv[3:])); d = sys.argv[1]\n"
                "if d: os.makedirs(d + '/tokens_per_expert', exist_ok=True); "
                "open(d + '/tokens_per_expert/rank0.jsonl', 'a').write(sys.argv[2])")
        return [sys.executable, "-c", code, save or "", records, *lines]

    def writes(run_dir, curve):
        text = "".join(json.dumps({"step": s, "loss": v["loss"], "grad_norm": 1.0, "moe_aux_loss": v["moe_aux_loss"],
                                   "moe_z_loss": v["moe_z_loss"], **({"moe_expert_load": v["load"]} if s % 10 == 0
                                                                      else {})}) + "\n" for s, v in curve.items())
        return [sys.executable, "-c", "import os, sys; os.makedirs(sys.argv[1], exist_ok=True); "
                "open(sys.argv[1] + '/metrics.jsonl', 'w').write(sys.argv[2])", str(run_dir), text]

    def fake(setup, work, runs, mlm, blend, tokenizer):
        made = real(setup, work, runs, mlm, CORPORA, tokenizer)
        cmds = {}
        for job in made:
            if job.name in PROCESSES:
                name, first = PROCESSES[job.name]
                curve = {s: v for s, v in values[name].items() if first is None or (s <= setup.flip) == first}
                records = "--save-tokens-per-expert-interval" in job.cmd
                cmds[job.name] = prints(curve, job.cmd[job.cmd.index("--save") + 1] if records else None)
            elif job.name in values:
                cmds[job.name] = writes(runs / job.name, values[job.name])
            else:  # the import: ours-moe-fp8-a's run directory is its own
                cmds[job.name] = [sys.executable, "-c", ""]
        return [dataclasses.replace(job, cmd=[sys.executable, "-c", "raise SystemExit(3)"] if job.name in fail
                                    else cmds[job.name], estimate_s=1) for job in made]

    return fake


KEYS = ("loss", "moe_aux_loss", "moe_z_loss")


@pytest.fixture
def moe_harness(tmp_path, monkeypatch):
    real = moe.moe_jobs
    monkeypatch.setattr(harness, "prepare", lambda work, tokenizer, megabytes: [])
    (tmp_path / "work" / "init-moe-megatron").mkdir(parents=True)
    (tmp_path / "work" / "init-moe-megatron" / "latest_checkpointed_iteration.txt").write_text("release")

    def call(out, *args, values=None, fail=()):
        monkeypatch.setattr(moe, "moe_jobs", stood_in_moe(real, values or stood_in(), fail))
        code = harness.main(["--megatron-lm", str(tmp_path), "--tokenizer", "t.model", "--work", str(tmp_path / "work"),
                             "--budget-s", "120", "--out", str(tmp_path / out), "--moe", *args])
        return code, rows(tmp_path / out)

    return call


BF16_LOSS, FP8_LOSS = "MoE BF16, 1..end: LM loss", "MoE FP8 from the flip: LM loss"
LOADS = moe.LOAD_ROW[0]


def tail(units: int, run: str = "megatron-moe-a", key: str = "loss") -> str:
    """``units``/32 over the sum of the reference's last 10 steps' ``key``, as the summary writes a relative
    difference."""
    reference = stood_in()[run]
    return f"{100 * units / 32 / sum(reference[s][key] for s in range(291, 301)):+.3f} %"


def test_the_moe_call_reports_each_row_beside_its_spread(moe_harness, tmp_path):
    """Ours 1/32 off on 25 of the last 100 steps, each spread on 50 (the second line of each Megatron process taken
    apart: the spreads would read more otherwise); the router's losses as the LM loss; ours' loads turned on half
    the recorded steps, B's on all; every figure drawn; the curves and loads packed for --report-from."""
    import tarfile

    code, rows = moe_harness("call")
    assert code == 0
    for what, key in (("LM loss", "loss"), ("load-balancing loss", "moe_aux_loss")):
        for mode, ref in (("BF16, 1..end", "megatron-moe-a"), ("FP8 from the flip", "megatron-moe-fa")):
            assert rows[f"MoE {mode}: {what}"] == ["0.0078", "0.0156", "0.50", tail(2, ref, key), tail(5, ref, key),
                                                   "yes"]
    assert rows["MoE BF16, 1..end: router z-loss"][:3] == ["0.0156", "0.0312", "0.50"]
    turned = 0.5 * 4 * (7 * 16 + 112) / (4 * sum(range(64, 177, 16)))  # one expert on: 7 steps of 16, one of 112
    assert rows[LOADS] == [f"{turned / 2:.4f}", f"{turned:.4f}", "0.50", f"{turned:.4f} at step 300", f"{turned:.4f}",
                           "yes"]
    assert all((tmp_path / "call" / png).read_bytes()[:4] == b"\x89PNG"
               for png in ("parity-moe-bf16.png", "parity-moe-fp8.png", "parity-moe-router.png"))
    with tarfile.open(tmp_path / "call" / "parity-curves.tgz") as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    assert harness.main(["--report-from", str(tmp_path / "unpacked"), "--moe", "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "summary-parity.md").read_text().split("\n- ")[0].rstrip() == \
        (tmp_path / "call" / "summary-parity.md").read_text().split("\n- ")[0].rstrip()
    summary = (tmp_path / "call" / "summary-parity.md").read_text()
    assert "| run | loss / grad norm / load-balancing loss at step 1 | 2 | 151 | 152 |" in summary
    assert "- M-FB: done" in summary and "M-FAu" not in summary  # the second call's runs: not without --only
    assert rows[FP8_A_LOSS][0] == "not run"


FP8_A_LOSS = "MoE FP8 from A's checkpoint: LM loss"


def test_the_second_moe_call_reports_the_fp8_half_from_as_checkpoint(moe_harness, tmp_path):
    """--only with the second call's runs: the FP8 half from A's checkpoint, ours against FA beside FAu (ours off on
    25 of the last 100 steps, FAu on 50), the first call's rows not run; the two calls' curves together give every
    row."""
    import tarfile

    code, rows = moe_harness("second", "--only", ",".join(moe.CALLS[1]))
    assert code == 0
    assert rows[FP8_A_LOSS] == ["0.0078", "0.0156", "0.50", tail(2, "megatron-moe-fa"), tail(5, "megatron-moe-fa"),
                                "yes"]
    assert rows[BF16_LOSS][0] == rows[FP8_LOSS][0] == "not run"
    assert (tmp_path / "second" / "parity-moe-fp8-a.png").read_bytes()[:4] == b"\x89PNG"
    code, rows = moe_harness("strays", "--only", ",".join(moe.CALLS[1]), values=stood_in(off=2))
    assert rows[FP8_A_LOSS][2:] == ["4.50", tail(2 * 10 + 2, "megatron-moe-fa"), tail(5, "megatron-moe-fa"), "NO"]
    code, _ = moe_harness("first")
    for call in ("first", "second"):
        with tarfile.open(tmp_path / call / "parity-curves.tgz") as tar:
            tar.extractall(tmp_path / "unpacked" / call, filter="data")
    assert harness.main(["--report-from", str(tmp_path / "unpacked" / "first"), str(tmp_path / "unpacked" / "second"),
                         "--moe", "--out", str(tmp_path / "both")]) == 0
    both = (tmp_path / "both" / "summary-parity.md").read_text()
    assert "not run" not in both and both.count("| yes |") == 10


def test_an_moe_gap_over_the_spread_or_off_at_the_end_fails_its_row(moe_harness):
    code, rows = moe_harness("strays", values=stood_in(off=2))  # 2/32 more everywhere: 4.5 times the spread
    assert code == 0 and rows[BF16_LOSS][2:] == ["4.50", tail(2 * 10 + 2), tail(5), "NO"]
    code, rows = moe_harness("late", values=stood_in(tail_off=1))  # within the spread but 1/32 off at the end
    assert rows[BF16_LOSS][2:] == ["0.70", tail(10 + 2), tail(5), "NO"]


def test_a_failed_moe_run_fails_the_call_and_skips_what_follows_it(moe_harness, tmp_path):
    code, rows = moe_harness("failed", fail=("M-B1",))
    summary = (tmp_path / "failed" / "summary-parity.md").read_text()
    assert code == 1 and "- M-B1: failed" in summary and "- M-FB: skipped" in summary and "- M-A2: done" in summary
    assert rows[BF16_LOSS][0] == "not run" and rows[LOADS][0] == "not run"


def test_only_names_the_moe_runs(moe_harness, capsys):
    with pytest.raises(SystemExit):
        moe_harness("refused", "--only", "M-A2")
    assert "--only names M-A2, which starts after M-A1: name M-A1 too" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        moe_harness("refused", "--only", "A1")
    assert "not among the runs of --moe" in capsys.readouterr().err


def test_run_ak_gives_the_documented_fp8_half_from_as_checkpoint(tmp_path):
    """Run AK's second call on the H100 (docs/perf-raw/run-ak/call-2): Megatron-LM's checkpoint of step 150 at EP 1
    imported and trained in FP8 beside Megatron's FP8 restarts from it, fused (FA) and not (FAu, the spread)."""
    import tarfile

    raw = Path(__file__).resolve().parents[1] / "docs" / "perf-raw" / "run-ak" / "call-2" / "parity-curves.tgz"
    with tarfile.open(raw) as tar:
        tar.extractall(tmp_path / "curves", filter="data")
    assert harness.main(["--report-from", str(tmp_path / "curves"), "--moe", "--out", str(tmp_path / "out")]) == 0
    got = rows(tmp_path / "out")
    assert got[FP8_A_LOSS] == ["0.0009", "0.0008", "1.12", "-0.008 %", "-0.008 %", "yes"]
    assert got["MoE FP8 from A's checkpoint: router z-loss"][2] == "0.85"
    assert got[BF16_LOSS][0] == "not run"
