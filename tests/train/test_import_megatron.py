"""``llmjp-ds import-megatron`` on checkpoints megatron-core wrote (tests/fixtures/megatron/, made by its
make_fixtures.py; more fixture directories can be named in ``LLMJP_DS_MEGATRON_FIXTURES``, ``:``-separated).

For every fixture: the reader takes each weight and its fp32 master weight and Adam moments whole, whatever the
format and layout, and each weight is its master weight in the model's dtype. Against megatron-core's own numbers
(the canonical fixture's ``reference.pt``): the master weights and moments of every layout carry the fingerprints
megatron-core's optimizer gave each parameter, and our model with the imported weights computes megatron-core's
logits. The importer writes a run that ``llmjp-ds train`` resumes at Megatron's iteration with its LR schedule,
data position and optimizer state: the first step's update is AdamW's from the imported moments and step count.

A fixture directory holds ``save/`` (Megatron-LM's ``--save`` directory), ``fixture.json`` (``format``,
``iteration``, ``global_batch_size``, ``seq_length``, ``vocab_size`` (padded), ``hidden_size``, ``num_layers``,
``num_attention_heads``, ``num_query_groups``, ``ffn_hidden_size``, ``schedule``, ``made_by``; where known
``precision``, ``clip_grad``, ``betas``, ``eps``; an MoE model's ``num_experts``, ``moe_router_topk``,
``moe_ffn_hidden_size``, ``moe_layer_freq``, ``model``: tests/train/test_import_megatron_moe.py) and, optionally,
``reference.pt``
(``tokens``, megatron-core's fp32 ``logits`` on them at the checkpoint's master weights, and per parameter under
Megatron's name the ``fingerprints`` of its ``param``, ``exp_avg`` and ``exp_avg_sq``, as make_fixtures.py's
``_fingerprint`` computes them).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from llmjp_ds.interchange import megatron_adapter as ma

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron"
CANONICAL = FIXTURES / "torch-tp1pp1"
DIRS = sorted({p.parent for p in FIXTURES.glob("*/fixture.json")} |
              {Path(p) for p in os.environ.get("LLMJP_DS_MEGATRON_FIXTURES", "").split(":") if p})


def fixture_info(d: Path) -> dict:
    return json.loads((d / "fixture.json").read_text())


def read(d: Path):
    from llmjp_ds.interchange.megatron_reader import read as read_megatron

    return read_megatron(d / "save")


def shape_of(info: dict) -> dict:
    """The fixture's model as ``model.shape`` and ``model.overrides`` fields (an MoE model's experts too)."""
    shape = {"hidden_size": info["hidden_size"], "num_layers": info["num_layers"],
             "num_attention_heads": info["num_attention_heads"], "num_key_value_heads": info["num_query_groups"],
             "ffn_hidden_size": info["ffn_hidden_size"], "vocab_size": info["vocab_size"],
             "seq_len": info["seq_length"]}
    if "num_experts" not in info:
        return {"shape": "tiny", **shape}
    freq = info["moe_layer_freq"]
    pattern = freq if isinstance(freq, list) else [int(i % freq == 0) for i in range(info["num_layers"])]
    return {"shape": "tiny-moe", **shape, "head_dim": info["hidden_size"] // info["num_attention_heads"],
            "num_experts": info["num_experts"], "experts_per_token": info["moe_router_topk"],
            "moe_ffn_hidden_size": info["moe_ffn_hidden_size"],
            "dense_layers": [i for i, moe in enumerate(pattern) if not moe]}


def config_of(info: dict):
    from llmjp_ds.model.shapes import model_config

    return model_config(**shape_of(info))


def weight_count(info: dict) -> int:
    """How many weights a model of the fixture's has: 6 per dense layer; an MoE layer's attention (3, and 2
    qk-norms), its norm, its router and two per expert."""
    if "num_experts" not in info:
        return 3 + 6 * info["num_layers"]
    dense = len(shape_of(info)["dense_layers"])
    return 3 + 5 * info["num_layers"] + 3 * dense + (info["num_layers"] - dense) * (2 + 2 * info["num_experts"])


def fingerprint(t: torch.Tensor) -> torch.Tensor:  # make_fixtures.py's
    flat = t.detach().double().flatten()
    return torch.stack([flat.sum(), (flat * flat).sum(),
                        (flat * torch.linspace(-1.0, 1.0, flat.numel(), dtype=torch.float64)).sum()])


@pytest.mark.parametrize("d", DIRS, ids=[d.name for d in DIRS])
def test_reader_takes_every_weight_and_its_state(d):
    info, ckpt = fixture_info(d), read(d)
    assert (ckpt.fmt, ckpt.iteration, ckpt.step) == (info["format"], info["iteration"], info["iteration"])
    assert ckpt.scheduler["num_steps"] == info["iteration"] * info["global_batch_size"]
    ours = ma.from_megatron_state_dict(ckpt.weights, config_of(info))  # every weight, each of its shape
    assert len(ours) == weight_count(info)
    assert ckpt.optimizer is not None and ckpt.optimizer.keys() == ckpt.weights.keys()
    for name, weight in ckpt.weights.items():
        state = ckpt.optimizer[name]
        assert {k: v.shape for k, v in state.items()} == {k: weight.shape for k in ("param", "exp_avg", "exp_avg_sq")}
        assert torch.equal(state["param"].to(weight.dtype), weight), name  # megatron-core copies master -> model
        if "on CPU" in info["made_by"]:  # make_(moe_)fixtures.py: every element got a gradient, none left at zero
            assert (state["exp_avg_sq"] > 0).all(), name
    assert not any(ma.is_extra_state(n) for n in ckpt.weights)  # TE's extra state is dropped


def reference_of(d: Path) -> Path | None:
    """The fixture's own ``reference.pt``, or that of the fixture of the same model made by the same script (every
    layout started from the same weights by make_fixtures.py or make_moe_fixtures.py)."""
    if (d / "reference.pt").is_file():
        return d / "reference.pt"
    same = ("made_by", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
            "vocab_size", "iteration", "model")
    return next((r / "reference.pt" for r in DIRS if (r / "reference.pt").is_file() and
                 all(fixture_info(d).get(k) == fixture_info(r).get(k) for k in same)), None)


REFERENCED = [d for d in DIRS if reference_of(d)]


@pytest.mark.parametrize("d", REFERENCED, ids=[d.name for d in REFERENCED])
def test_every_layout_carries_megatron_cores_optimizer_state(d):
    """Each parameter's master weight and moments, TP-merged and renumbered, are those megatron-core's optimizer
    holds for that parameter (its fingerprints): a moment on the wrong parameter, a wrong bucket offset, a
    plain split of fc1 or a stage's layers out of place would each change them. The master weights of an MoE model
    at EP 1 (its experts in the dense optimizer, not one of their own) come within a few fp32 roundings of the
    update (1.2e-8 on weights of 0.03-0.17; the moments exactly), against a whole update of up to 1e-2 (the LR)
    by any of those faults."""
    reference = torch.load(reference_of(d))["fingerprints"]
    ckpt = read(d)
    names = ma.canonical_names(reference)
    info = fixture_info(d)
    param_atol = 5e-8 if info.get("num_experts") and info.get("expert_parallel") == 1 else 1e-9
    for name, prints in reference.items():
        state = ckpt.optimizer[names[name]]
        for key, expected in prints.items():
            atol = param_atol if key == "param" else 1e-9
            assert torch.allclose(fingerprint(state[key]), expected, rtol=1e-6, atol=atol), (name, key)


@pytest.mark.parametrize("d", [d for d in DIRS if (d / "reference.pt").is_file()],
                         ids=[d.name for d in DIRS if (d / "reference.pt").is_file()])
def test_imported_weights_compute_megatron_cores_logits(d):
    """Our model, with the fixture's master weights through from_megatron_state_dict, computes the logits
    megatron-core's GPTModel computed with them (fp32, the same input): the QKV, fc1 and norm layouts agree."""
    from llmjp_ds.model import LlamaForCausalLM

    info, ckpt = fixture_info(d), read(d)
    reference = torch.load(d / "reference.pt")
    masters = {name: state["param"] for name, state in ckpt.optimizer.items()}
    model = LlamaForCausalLM(config_of(info), backend="torch").eval()
    model.load_state_dict(ma.from_megatron_state_dict(masters, config_of(info)), strict=False)
    with torch.no_grad():
        logits = model(reference["tokens"]).logits.float()
    scale = reference["logits"].abs().max()
    assert (logits - reference["logits"]).abs().max() <= 1e-5 * scale


def test_tp_and_pp_shards_merge_to_the_unsharded_model():
    base = read(CANONICAL).weights
    for name in ("torch-tp2pp2", "torch_dist-tp2dp2-dp_reshardable", "torch_dist-pp2dp2-fully_reshardable"):
        weights = read(FIXTURES / name).weights
        assert weights.keys() == base.keys()
        assert all(torch.equal(weights[k], base[k]) for k in base), name


def small_tokenizer(path: Path) -> Path:
    """A SentencePiece model of 200 pieces (no byte fallback): Megatron pads it to the fixtures' 256 rows."""
    import sentencepiece as spm

    import random

    rng = random.Random(0)
    text = path.parent / "text.txt"
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 7))) for _ in range(3000)]
    text.write_text("\n".join(" ".join(words[k:k + 12]) for k in range(0, len(words), 12)))
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(path), vocab_size=200, model_type="unigram",
                                   byte_fallback=False, bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2)
    return path.with_suffix(".model")


def import_sets(tmp_path: Path, info: dict) -> list[str]:
    import numpy as np

    from tests.data.data_helpers import random_documents, write_corpus

    prefix = write_corpus(tmp_path / "corpus" / "c_text_document",
                          random_documents(np.random.default_rng(0), 200, high=200, max_len=80))
    fields = shape_of(info)
    overrides = "{" + ", ".join(f"{k}: {v}" for k, v in fields.items() if k != "shape") + "}"
    return [f"model.shape={fields['shape']}", f"model.overrides={overrides}",
            f"data.tokenizer={small_tokenizer(tmp_path / 'sp')}",
            f"data.blend=[{prefix}]", f"data.seq_len={info['seq_length']}",
            f"train.global_batch_size={info['global_batch_size']}",
            f"train.micro_batch_size={info['global_batch_size']}", "train.steps=20", "precision.dtype=fp32",
            "model.z_loss=0", "logging.wandb=disabled", "train.eval_interval=0", "checkpoint.async_save=false",
            "model.backend=torch"]


@pytest.mark.parametrize("d", DIRS, ids=[d.name for d in DIRS])
def test_import_writes_a_run_at_megatrons_iteration(d, tmp_path):
    """The run continues Megatron's schedule as its generator set it (fixture.json), at its iteration and consumed
    samples, with each parameter's master weight and moments as the reader took them."""
    from llmjp_ds.interchange.megatron import import_megatron
    from llmjp_ds.config import load_config
    from llmjp_ds.parallel.reshape import CONVERTED

    info, schedule = fixture_info(d), fixture_info(d)["schedule"]
    out = import_megatron(d / "save", tmp_path / "run", sets=import_sets(tmp_path, info))
    cfg = load_config(tmp_path / "run" / "config.yaml")
    assert (out["step"], out["consumed_samples"]) == (info["iteration"], info["iteration"] * info["global_batch_size"])
    assert (cfg.optim.schedule, cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.decay_steps) == \
        ("megatron", schedule["lr"], schedule["warmup_iters"], schedule["decay_iters"])
    assert cfg.optim.min_lr == schedule["min_lr"] and cfg.optim.min_lr_ratio is None  # Megatron's, exactly
    assert cfg.optim.weight_decay == schedule["weight_decay"]
    if "betas" in info:
        assert (cfg.optim.beta1, cfg.optim.beta2, cfg.optim.eps) == (*info["betas"], info["eps"])
    if "clip_grad" in info:
        assert cfg.optim.clip_grad == info["clip_grad"]
    tag = f"step{info['iteration']:08d}"
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == tag
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".run.")]  # nothing left beside it
    ckpt = read(d)
    for name in ma.from_megatron_state_dict(ckpt.weights, config_of(info)):
        path = tmp_path / "run" / "checkpoints" / tag / CONVERTED / f"{name}.pt"
        written = torch.load(path)
        theirs = ckpt.optimizer[ma.megatron_name(name)]
        assert all(torch.equal(written[ours], theirs[key]) for ours, key in
                   (("fp32", "param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"))), name
        # each file holds its parameter's state alone, not the optimizer buffer the reader took it from
        assert path.stat().st_size <= 12 * theirs["param"].numel() + 4096, (name, path.stat().st_size)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_continues_the_megatron_run(train_env, tmp_path):
    """One step of ``llmjp-ds train`` on the imported run: it is step 4 of Megatron's run, at megatron-core's LR
    for it, on the samples after Megatron's consumed ones, and its update is AdamW's from the imported master
    weights, moments and step count (computed here with torch's AdamW on the same batch)."""
    import numpy as np

    from llmjp_ds.checkpoint import read_marker, read_model_state
    from llmjp_ds.config import load_config, model_config_of
    from llmjp_ds.model import LlamaForCausalLM
    from llmjp_ds.parallel.reshape import CONVERTED
    from llmjp_ds.trainer import data_plan
    from tests.launch import free_port, run_command, subprocess_env
    from tests.runs import trail
    from tests.test_lr_schedule import megatron_lrs

    info = fixture_info(CANONICAL)
    run = tmp_path / "run"
    from llmjp_ds.interchange.megatron import import_megatron

    import_megatron(CANONICAL / "save", run, sets=import_sets(tmp_path, info))
    run_command([sys.executable, "-m", "llmjp_ds.train", "--config", str(run / "config.yaml"), "--set",
                 "train.steps=4"], tmp_path / "train", env=subprocess_env(MASTER_PORT=str(free_port())))
    (logged,) = trail(run)
    schedule = info["schedule"]
    lrs = megatron_lrs(4, info["global_batch_size"], schedule["lr"], schedule["min_lr"], schedule["warmup_iters"],
                       schedule["decay_iters"])
    assert logged["step"] == 4 and logged["consumed_samples"] == 32
    assert logged["lr"] == pytest.approx(lrs[3], rel=1e-12)

    cfg = load_config(run / "config.yaml")
    model_config = model_config_of(cfg)
    model = LlamaForCausalLM(model_config, backend="torch")
    tag_dir = run / "checkpoints" / "step00000003" / CONVERTED
    states = {n: torch.load(tag_dir / f"{n}.pt") for n, _ in model.named_parameters()}
    model.load_state_dict({n: s["fp32"] for n, s in states.items()}, strict=False)
    train_ds, _ = data_plan(cfg, model_config).build(cfg.data.seq_len or info["seq_length"], 40, 0)
    tokens = torch.from_numpy(np.stack([np.asarray(train_ds[i], dtype=np.int64) for i in range(24, 32)]))
    logits = model(tokens[:, :-1]).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    assert logged["loss"] == pytest.approx(loss.item(), rel=1e-5)
    loss.backward()
    params = dict(model.named_parameters())
    groups = [{"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": cfg.optim.weight_decay},
              {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}]
    adam = torch.optim.AdamW(groups, lr=lrs[3], betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps)
    for name, p in params.items():
        adam.state[p] = {"step": torch.tensor(3.0), "exp_avg": states[name]["exp_avg"].clone(),
                         "exp_avg_sq": states[name]["exp_avg_sq"].clone()}
    adam.step()
    after = read_model_state(run, "step00000004", read_marker(run, "step00000004"))
    for name, p in params.items():
        assert torch.allclose(after[name], p.detach(), rtol=1e-5, atol=1e-7), name


def test_flattened_model_space_state_is_put_back():
    """megatron-core 0.14's fully_sharded_model_space stores a tensor of shape [X, Y] split in local chunks
    [x, y] as [X/x, Y/y, x*y], each chunk flattened at its grid index (no fixture of it: 0.16 cannot write it)."""
    from llmjp_ds.interchange.megatron_dist_optim import unflatten

    whole = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)
    grid = torch.stack([torch.stack([whole[i * 2:(i + 1) * 2, j * 3:(j + 1) * 3].flatten() for j in range(2)])
                        for i in range(2)])  # [2, 2, 6]
    assert torch.equal(unflatten(grid, (4, 6), "k"), whole)
    assert unflatten(whole, (4, 6), "k") is whole


def test_layers_of_each_stage_and_chunk():
    from llmjp_ds.interchange.megatron_dist_optim import stage_layers

    args = dict
    assert stage_layers(args(num_layers=8, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)) \
        == [[range(0, 2), range(2, 4)], [range(4, 6), range(6, 8)]]
    uneven = args(num_layers=7, pipeline_model_parallel_size=3, decoder_first_pipeline_num_layers=1)
    assert stage_layers(uneven) == [[range(0, 1), range(1, 4), range(4, 7)]]


REAL = FIXTURES / "te-torch-dist-fp8"  # Megatron-LM's own checkpoint (megatron-core 0.19.2)


def test_arguments_of_every_release_are_read_under_one_name(tmp_path):
    """megatron-core 0.19's Megatron-LM takes --norm-epsilon's value as TransformerConfig's ``layernorm_epsilon``
    (and --apply-layernorm-1p's as ``layernorm_zero_centered_gamma``); older releases wrote ``norm_epsilon`` /
    ``apply_layernorm_1p``. Either is read, so a run of epsilon 1e-6 is not taken for the default 1e-5."""
    from llmjp_ds.interchange.megatron import check_config
    from llmjp_ds.interchange.megatron_reader import current_names
    from llmjp_ds.config import load_config, model_config_of
    from llmjp_ds.errors import UserError

    ckpt = read(REAL)
    assert "norm_epsilon" not in ckpt.args and ckpt.args["layernorm_epsilon"] == 1e-5
    ckpt.args["layernorm_epsilon"] = 1e-6
    cfg = load_config(None, [*import_sets(tmp_path, fixture_info(REAL)), f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(UserError, match="has norm_epsilon=1e-06, the run config model.overrides.rms_norm_eps=1e-05"):
        check_config(ckpt, cfg, model_config_of(cfg))
    older = {"norm_epsilon": 1e-6, "apply_layernorm_1p": True, "disable_bias_linear": True}
    assert {k: current_names(older)[k] for k in ("layernorm_epsilon", "layernorm_zero_centered_gamma",
                                                  "add_bias_linear")} == {"layernorm_epsilon": 1e-6,
                                                                          "layernorm_zero_centered_gamma": True,
                                                                          "add_bias_linear": False}
    both = {"layernorm_epsilon": 1e-5, "norm_epsilon": 1e-6}  # the current name is the run's
    assert current_names(both)["layernorm_epsilon"] == 1e-5


@pytest.mark.parametrize("setting", [{"layernorm_zero_centered_gamma": True}, {"use_rope_scaling": True},
                                     {"rope_type": "yarn"}, {"window_size": (256, 0)}, {"softmax_type": "learnable"},
                                     {"mtp_num_layers": 1}, {"multi_latent_attention": True}])
def test_runs_that_are_no_llama_are_refused(setting):
    """What changes the model's arithmetic without changing its weights' names or shapes is refused by the run's
    arguments (the weights alone would import, and compute something else); the real run's own are accepted."""
    from llmjp_ds.interchange.megatron_reader import check_supported
    from llmjp_ds.errors import UserError

    args = read(REAL).args
    check_supported(args, REAL)
    (name, value), = setting.items()
    with pytest.raises(UserError, match=re.escape(f"was trained with {name}={value!r}: llmjp-ds continues Llama")):
        check_supported({**args, **setting}, REAL)


TE_DIRS = [d for d in DIRS if "Transformer Engine" in fixture_info(d)["made_by"]]


def file_names(d: Path) -> set[str]:
    """The model's entries as the fixture's files name them, weights and ``_extra_state`` (torch_dist's stacked
    ``decoder.layers.<rest>`` as one name per layer)."""
    from llmjp_ds.interchange.dcp_reader import DistCheckpoint
    from llmjp_ds.checkpoint.safe_load import load_megatron

    info, directory = fixture_info(d), next((d / "save").glob("iter_*"))
    if info["format"] == "torch":
        return set(load_megatron(directory / "mp_rank_00" / "model_optim_rng.pt")["model"])
    keys = {k.split("/")[0] for k in DistCheckpoint(directory).entries}
    keys -= {"common_state", "rng_state", "rerun_state_machine_state"}
    keys = {k for k in keys if not k.startswith("optimizer.")}
    layer = "decoder.layers."
    return {f"{layer}{i}.{k[len(layer):]}" if k.startswith(layer) else k
            for k in keys for i in range(info["num_layers"])}


@pytest.mark.parametrize("d", TE_DIRS, ids=[d.name for d in TE_DIRS])
def test_te_spec_names_are_megatron_cores(d):
    """The adapter's TE-spec names are those megatron-core 0.19 writes (no alias needed), and every ``_extra_state``
    entry belongs to a TE module of the spec: the linear layers and norms of the weights, and the attention core."""
    info, names = fixture_info(d), file_names(d)
    ours = ma.from_megatron_state_dict(read(d).weights, config_of(info))
    assert {n for n in names if not ma.is_extra_state(n)} == {ma.megatron_name(n) for n in ours}
    modules = {ma.megatron_name(n).rsplit(".", 1)[0] for n in ours}
    extra = {n[:-len("._extra_state")] for n in names if ma.is_extra_state(n)}
    linear = {f"decoder.layers.{i}.{m}" for i in range(info["num_layers"]) for m in
              ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")}
    core = {f"decoder.layers.{i}.self_attention.core_attention" for i in range(info["num_layers"])}
    assert linear <= extra and extra <= modules | core, sorted(extra - modules - core)


def twins() -> list[tuple[Path, Path]]:
    """(torch, torch_dist) fixtures of one run: fixture.json alike but for the format, the precision known."""
    def rest(d):
        return {k: v for k, v in fixture_info(d).items() if k != "format"}
    by_format = {f: [d for d in DIRS if fixture_info(d)["format"] == f and "precision" in fixture_info(d)]
                 for f in ("torch", "torch_dist")}
    return [(a, b) for a in by_format["torch"] for b in by_format["torch_dist"] if rest(a) == rest(b)]


@pytest.mark.parametrize("legacy, dist", twins(), ids=[f"{a.name}+{b.name}" for a, b in twins()])
def test_both_formats_of_one_run_agree(legacy, dist):
    """Megatron-LM saved one run (the same arguments and seed) in both formats, and its numbers came out bitwise
    equal: the two readers, distrib_optim.pt's buffers in the state dict's order and torch_dist's buckets in the TE
    spec's registration order (``_ATTENTION_ORDER``), take the same weights, optimizer state, step and schedule."""
    a, b = read(legacy), read(dist)
    assert (a.iteration, a.step, a.scheduler) == (b.iteration, b.step, b.scheduler)
    assert a.arg("consumed_train_samples") == b.arg("consumed_train_samples")
    assert a.weights.keys() == b.weights.keys() == a.optimizer.keys() == b.optimizer.keys()
    for name in a.weights:
        assert torch.equal(a.weights[name], b.weights[name]), name
        assert all(torch.equal(a.optimizer[name][k], b.optimizer[name][k]) for k in a.optimizer[name]), name


FP8_DIRS = [d for d in TE_DIRS if fixture_info(d).get("precision") == "fp8"]


def extra_states(d: Path) -> dict[str, bytes]:
    """TE's pickled extra state per entry, as bytes (nothing of it unpickled)."""
    from llmjp_ds.interchange.dcp_reader import DistCheckpoint
    from llmjp_ds.checkpoint.safe_load import load_megatron

    directory = next((d / "save").glob("iter_*"))
    if fixture_info(d)["format"] == "torch":
        model = load_megatron(directory / "mp_rank_00" / "model_optim_rng.pt")["model"]
        return {k: v.numpy().tobytes() for k, v in model.items() if ma.is_extra_state(k) and v is not None}
    dcp = DistCheckpoint(directory)
    return {f"{k}/{shard}": value[0].numpy().tobytes() for k in {e.split("/")[0] for e in dcp.entries}
            if ma.is_extra_state(k) for shard, value in dcp.objects(k).items()}


@pytest.mark.parametrize("d", FP8_DIRS, ids=[d.name for d in FP8_DIRS])
def test_fp8_extra_state_is_dropped_unread(d, monkeypatch):
    """An FP8 run's extra state is a pickle per TE module of Megatron's TEDelayedScaling recipe with its scales and
    amax histories: the import reads it as bytes and drops it. With the modules that pickle names made unimportable
    the checkpoint still imports, so nothing unpickled it (the safe reader would refuse Megatron's recipe class;
    pickle would fail to import it)."""
    states = extra_states(d)
    recipes = [k for k, v in states.items() if b"TEDelayedScaling" in v and b"amax_history_fwd" in v]
    assert len(recipes) >= 4 * fixture_info(d)["num_layers"], sorted(states)
    for module in ("transformer_engine", "transformer_engine.common.recipe", "megatron.core.extensions",
                   "megatron.core.extensions.transformer_engine", "megatron.core.safe_globals"):
        monkeypatch.setitem(sys.modules, module, None)
    ckpt = read(d)
    assert len(ma.from_megatron_state_dict(ckpt.weights, config_of(fixture_info(d)))) == 3 + 6 * ckpt.arg("num_layers")


def test_a_tensor_whose_chunks_do_not_cover_it_is_refused():
    """A torch_dist tensor is assembled from its chunks (here one per tensor-parallel rank); a tensor that the
    metadata's chunks do not cover is one line, not a tensor with uninitialised memory."""
    from llmjp_ds.interchange.dcp_reader import DistCheckpoint
    from llmjp_ds.errors import UserError

    directory = next((FIXTURES / "torch_dist-tp2dp2-dp_reshardable" / "save").glob("iter_*"))
    dcp = DistCheckpoint(directory)
    key = next(k for k in dcp.tensor_keys() if len(dcp.entries[k].chunks) > 1)
    whole = dcp.tensor(key)
    assert tuple(whole.shape) == dcp.shape(key)
    dcp.entries[key].chunks = dcp.entries[key].chunks[:-1]
    with pytest.raises(UserError, match=r"stores only \d+ of the \d+ elements of .*: the checkpoint is incomplete"):
        dcp.tensor(key)
