"""``llmjp-ds import-megatron`` of a Megatron-Core MoE run (tests/fixtures/megatron/*moe*, written by megatron-core
0.16.1 on CPU with tests/fixtures/megatron/make_moe_fixtures.py: a Qwen3-MoE-style model, 4 experts top-2, in four
layouts). tests/train/test_import_megatron.py reads them as it reads every fixture (each weight, master weight and
moment against megatron-core's fingerprints, the run written at Megatron's iteration); here what only an MoE run has:
our model computes megatron-core's logits in every layout (and would not with two experts swapped), the layouts of
one model agree bit for bit, the expert-parallel files are found by the run's arguments, what the run config must
say about the experts is refused otherwise in one line naming both values, what our MoE block does not compute is
refused, and ``llmjp-ds train`` continues the run: its first step is AdamW's from the imported state on the loss of
our model with the imported weights, the router's losses included."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from llmjp_ds.errors import UserError
from llmjp_ds.interchange import megatron_adapter as ma
from tests.train.test_import_megatron import (DIRS, FIXTURES, config_of, fixture_info, import_sets, read,
                                              reference_of)

MOE_DIRS = [d for d in DIRS if "num_experts" in fixture_info(d)]
EP2 = FIXTURES / "torch-moe-ep2"


def _masters(d: Path) -> dict:
    return {name: state["param"] for name, state in read(d).optimizer.items()}


def _logits(d: Path, masters: dict, tokens: torch.Tensor) -> torch.Tensor:
    from llmjp_ds.model import LlamaForCausalLM

    config = config_of(fixture_info(d))
    model = LlamaForCausalLM(config, backend="torch").eval()
    model.load_state_dict(ma.from_megatron_state_dict(masters, config), strict=False)
    with torch.no_grad():
        return model(tokens).logits.float()


@pytest.mark.parametrize("d", MOE_DIRS, ids=[d.name for d in MOE_DIRS])
def test_every_moe_layout_computes_megatron_cores_logits(d):
    """Our MoE model with the master weights of each layout (experts from two or four files, numbered globally,
    merged over expert TP) computes megatron-core's GPTModel logits (fp32, EP 1, the same weights: within 2.3e-8
    of 0.25); with expert 0 and expert 3 of the last layer swapped they move by 2e-4, so a misnumbered expert would
    be seen."""
    reference = torch.load(reference_of(d))
    masters = _masters(d)
    scale = reference["logits"].abs().max()
    logits = _logits(d, masters, reference["tokens"])
    assert (logits - reference["logits"]).abs().max() <= 1e-5 * scale
    last = fixture_info(d)["num_layers"] - 1
    swapped = dict(masters)
    for k in (1, 2):
        a, b = (f"decoder.layers.{last}.mlp.experts.linear_fc{k}.weight{e}" for e in (0, 3))
        swapped[a], swapped[b] = masters[b], masters[a]
    assert (_logits(d, swapped, reference["tokens"]) - reference["logits"]).abs().max() > 20 * 1e-5 * scale


def test_layouts_of_one_model_agree_bit_for_bit():
    """EP 2 in the legacy format, TP 2 x PP 2 x EP 2, and EP 2 in torch_dist (dp_reshardable) of one model from
    one start: the same weights, master weights, moments, step and schedule."""
    base = read(EP2)
    for name in ("torch-moe-tp2pp2ep2", "torch_dist-moe-ep2-dp_reshardable"):
        other = read(FIXTURES / name)
        assert (other.iteration, other.step, other.scheduler) == (base.iteration, base.step, base.scheduler)
        assert other.weights.keys() == base.weights.keys() == other.optimizer.keys()
        assert all(torch.equal(other.weights[k], base.weights[k]) for k in base.weights), name
        assert all(torch.equal(other.optimizer[k][s], base.optimizer[k][s]) for k in base.optimizer
                   for s in ("param", "exp_avg", "exp_avg_sq")), name


def test_expert_rank_directories_are_told_from_pipeline_stages_by_the_arguments(tmp_path):
    """``mp_rank_00_001`` is pipeline stage 1 of a PP 2 run and expert rank 1 of an EP 2 run; with both, stage and
    expert rank follow the tensor rank in that order. A name the arguments do not explain is refused."""
    from llmjp_ds.interchange.megatron_reader import _rank_dirs

    for name in ("mp_rank_00_000", "mp_rank_00_001"):
        (tmp_path / name).mkdir()
    assert set(_rank_dirs(tmp_path, 1, 1, 2)) == {(0, 0, 0), (0, 0, 1)}
    assert set(_rank_dirs(tmp_path, 1, 2, 1)) == {(0, 0, 0), (0, 1, 0)}
    for pp, ep, layout in ((1, 1, "TP 1 x PP 1"), (2, 2, "TP 1 x PP 2 x EP 2")):
        with pytest.raises(UserError, match=f"holds mp_rank_00_00[01], which does not add up to the {layout} its "
                                            "arguments give"):
            _rank_dirs(tmp_path, 1, pp, ep)
    three = tmp_path / "three"
    for t, s, e in [(t, s, e) for t in range(2) for s in range(2) for e in range(2)]:
        (three / f"mp_rank_{t:02d}_{s:03d}_{e:03d}").mkdir(parents=True)
    assert _rank_dirs(three, 2, 2, 2)[(1, 0, 1)].name == "mp_rank_01_000_001"
    (three / "mp_rank_01_001_000").rmdir()
    with pytest.raises(UserError, match="lacks mp_rank_01_001_000: its arguments say TP 2 x PP 2 x EP 2"):
        _rank_dirs(three, 2, 2, 2)


def _copy(d: Path, tmp_path: Path) -> Path:
    shutil.copytree(d / "save", tmp_path / "save")
    return next((tmp_path / "save").glob("iter_*"))


def test_a_missing_or_foreign_expert_rank_file_is_refused(tmp_path):
    """The second expert rank's files missing is one line; files whose dense weights are not the first rank's (a
    directory mixing runs) are one line too."""
    from llmjp_ds.interchange.megatron_reader import read as read_megatron

    directory = _copy(EP2, tmp_path)
    moved = tmp_path / "aside"
    shutil.move(directory / "mp_rank_00_001", moved)
    with pytest.raises(UserError, match="lacks mp_rank_00_001: its arguments say TP 1 x PP 1 x EP 2"):
        read_megatron(tmp_path / "save")
    shutil.move(moved, directory / "mp_rank_00_001")
    path = directory / "mp_rank_00_001" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    state["model"]["decoder.layers.0.mlp.router.weight"] = state["model"]["decoder.layers.0.mlp.router.weight"] + 1
    torch.save(state, path)
    with pytest.raises(UserError, match="mp_rank_00_001's decoder.layers.0.mlp.router.weight differs from the first "
                                        "expert-parallel rank's"):
        read_megatron(tmp_path / "save")


def test_experts_split_over_another_tensor_parallel_size_are_refused_in_the_legacy_format():
    from llmjp_ds.interchange.megatron_reader import _legacy_layout

    args = dict(read(FIXTURES / "torch-moe-tp2pp2ep2").args)
    assert _legacy_layout(args, EP2) == (2, 2, 2, 2)
    with pytest.raises(UserError, match="expert_tensor_parallel_size=1 and tensor_model_parallel_size=2: .*save the "
                                        "run as torch_dist"):
        _legacy_layout({**args, "expert_tensor_parallel_size": 1}, EP2)


def test_moe_layer_freq_gives_the_dense_layers():
    from llmjp_ds.interchange.megatron_moe import dense_layers, layer_pattern

    assert layer_pattern({"num_layers": 4, "num_experts": 8, "moe_layer_freq": 2}) == [1, 0, 1, 0]
    assert dense_layers({"num_layers": 4, "num_experts": 8, "moe_layer_freq": [0, 1, 1, 1]}) == [0]
    assert dense_layers({"num_layers": 3, "num_experts": 8}) == []
    assert dense_layers({"num_layers": 3, "num_experts": None}) == [0, 1, 2]


CONFIG_MISMATCHES = [
    ("model.overrides.num_experts=8", "has num_experts=4, the run config model.overrides.num_experts=8"),
    ("model.overrides.experts_per_token=1",
     "has moe_router_topk=2, the run config model.overrides.experts_per_token=1"),
    ("model.overrides.moe_ffn_hidden_size=16",
     "has moe_ffn_hidden_size=8, the run config model.overrides.moe_ffn_hidden_size=16"),
    ("model.overrides.dense_layers=[0]", "has moe_layer_freq=1, dense layers=[], the run config "
                                         "model.overrides.dense_layers=[0]"),
    ("model.moe_aux_loss=seq_aux_loss", "has moe_router_load_balancing_type=aux_loss, the run config "
                                        "model.moe_aux_loss=seq_aux_loss"),
    ("model.moe_aux_loss_coeff=0.001", "has moe_aux_loss_coeff=0.01, the run config model.moe_aux_loss_coeff=0.001"),
    ("model.moe_z_loss_coeff=0", "has moe_z_loss_coeff=0.001, the run config model.moe_z_loss_coeff=0.0"),
    ("model.moe_capacity_factor=1.5", "has moe_expert_capacity_factor=None, the run config "
                                      "model.moe_capacity_factor=1.5: .*--set model.moe_capacity_factor=null"),
    ("model.shape=tiny", "has qk_layernorm=True, the run config model.overrides.qk_norm=False"),
]


@pytest.mark.parametrize("setting, message", CONFIG_MISMATCHES, ids=[s for s, _ in CONFIG_MISMATCHES])
def test_a_config_that_disagrees_with_the_experts_is_refused_in_one_line(tmp_path, setting, message):
    """Each of Megatron's MoE arguments against the run config: one line naming both values and the --set that
    agrees; nothing written."""
    from llmjp_ds.interchange.megatron import import_megatron

    sets = import_sets(tmp_path, fixture_info(EP2))
    if setting == "model.shape=tiny":  # a dense config: the experts' fields dropped from the overrides
        sets = [s if not s.startswith("model.overrides=") else s.split(", head_dim")[0] + "}" for s in sets]
    with pytest.raises(UserError, match=message) as refused:
        import_megatron(EP2 / "save", tmp_path / "run", sets=[*sets, setting])
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "run").exists()


UNSUPPORTED = [{"moe_router_score_function": "sigmoid"}, {"moe_router_pre_softmax": True},
               {"moe_router_enable_expert_bias": True}, {"moe_shared_expert_intermediate_size": 64},
               {"moe_router_load_balancing_type": "sinkhorn"},
               {"moe_router_load_balancing_type": ["aux_loss", "seq_aux_loss"]}, {"moe_input_jitter_eps": 0.01},
               {"moe_router_topk_scaling_factor": 2.5}, {"moe_use_legacy_grouped_gemm": True},
               {"moe_router_dtype": "fp64"}]


@pytest.mark.parametrize("setting", UNSUPPORTED, ids=[next(iter(s)) + "=" + str(next(iter(s.values())))
                                                      for s in UNSUPPORTED])
def test_moe_runs_that_compute_otherwise_are_refused(setting):
    """Routers and experts ours does not compute are refused by the run's arguments (their weights would import
    and compute something else); the fixtures' own arguments are accepted."""
    from llmjp_ds.interchange.megatron_reader import check_supported

    args = read(EP2).args
    check_supported(args, EP2)
    (name, value), = setting.items()
    with pytest.raises(UserError, match=re.escape(f"was trained with {name}={value!r}: llmjp-ds continues Llama")):
        check_supported({**args, **setting}, EP2)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_continues_the_megatron_moe_run(train_env, tmp_path):
    """One step of ``llmjp-ds train`` on the imported EP 2 run: step 4 at megatron-core's LR for it, its loss our
    model's on the samples after Megatron's consumed ones, and its update AdamW's from the imported master weights,
    moments and step count on the gradient of that loss with the router's aux and z losses (computed here)."""
    import numpy as np

    from llmjp_ds.checkpoint import read_marker, read_model_state
    from llmjp_ds.config import load_config, model_config_of, model_options_of
    from llmjp_ds.interchange.megatron import import_megatron
    from llmjp_ds.model import LlamaForCausalLM
    from llmjp_ds.parallel.reshape import CONVERTED
    from llmjp_ds.trainer import data_plan
    from tests.launch import free_port, run_command, subprocess_env
    from tests.runs import trail
    from tests.test_lr_schedule import megatron_lrs

    info = fixture_info(EP2)
    run = tmp_path / "run"
    import_megatron(EP2 / "save", run, sets=import_sets(tmp_path, info))
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
    model = LlamaForCausalLM(model_config, backend="torch", options=model_options_of(cfg))
    tag_dir = run / "checkpoints" / "step00000003" / CONVERTED
    states = {n: torch.load(tag_dir / f"{n}.pt") for n, _ in model.named_parameters()}
    model.load_state_dict({n: s["fp32"] for n, s in states.items()}, strict=False)
    train_ds, _ = data_plan(cfg, model_config).build(cfg.data.seq_len or info["seq_length"], 40, 0)
    tokens = torch.from_numpy(np.stack([np.asarray(train_ds[i], dtype=np.int64) for i in range(24, 32)]))
    out = model(tokens[:, :-1], shift_labels=tokens[:, 1:])
    assert logged["loss"] == pytest.approx(out.lm_loss.item(), rel=1e-5)
    assert out.loss.item() > out.lm_loss.item()  # the router's losses are part of what is minimised
    out.loss.backward()
    params = dict(model.named_parameters())
    groups = [{"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": cfg.optim.weight_decay},
              {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}]
    adam = torch.optim.AdamW(groups, lr=lrs[3], betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps)
    for name, p in params.items():
        adam.state[p] = {"step": torch.tensor(3.0), "exp_avg": states[name]["exp_avg"].clone(),
                         "exp_avg_sq": states[name]["exp_avg_sq"].clone()}
    adam.step()
    after = read_model_state(run, "step00000004", read_marker(run, "step00000004"))
    assert any(n.endswith("moe.experts.linear_fc1.weight3") for n in after)
    for name, p in params.items():
        assert torch.allclose(after[name], p.detach(), rtol=1e-5, atol=1e-7), name


def test_an_optimizer_count_the_arguments_cannot_give_is_refused_in_one_line(tmp_path):
    """At EP 1 megatron-core saves one optimizer (the experts in the dense buffers), at EP 2 two: a legacy
    ``distrib_optim.pt`` or torch_dist ``common.pt`` holding the other count is refused, naming what the arguments
    allow."""
    from llmjp_ds.interchange.megatron_reader import read as read_megatron

    directory = _copy(FIXTURES / "torch-moe-ep1", tmp_path)
    path = directory / "mp_rank_00" / "distrib_optim.pt"
    state = torch.load(path, weights_only=False)
    torch.save([state, state], path)
    with pytest.raises(UserError, match="holds 2 optimizer states .* where Megatron writes 1 for its arguments"):
        read_megatron(tmp_path / "save")
    shutil.rmtree(tmp_path / "save")
    common = _copy(FIXTURES / "torch_dist-moe-ep2-dp_reshardable", tmp_path) / "common.pt"
    state = torch.load(common, weights_only=False)
    state["optimizer"] = state["optimizer"][0]
    torch.save(state, common)
    with pytest.raises(UserError, match="holds 1 optimizers where megatron-core builds 2 for its arguments"):
        read_megatron(tmp_path / "save")
