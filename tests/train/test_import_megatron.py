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
``num_attention_heads``, ``num_query_groups``, ``ffn_hidden_size``, ``made_by``) and, optionally, ``reference.pt``
(``tokens``, megatron-core's fp32 ``logits`` on them at the checkpoint's master weights, and per parameter under
Megatron's name the ``fingerprints`` of its ``param``, ``exp_avg`` and ``exp_avg_sq``, as make_fixtures.py's
``_fingerprint`` computes them).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from llmjp_ds.model import megatron_adapter as ma

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron"
CANONICAL = FIXTURES / "torch-tp1pp1"
DIRS = sorted({p.parent for p in FIXTURES.glob("*/fixture.json")} |
              {Path(p) for p in os.environ.get("LLMJP_DS_MEGATRON_FIXTURES", "").split(":") if p})


def fixture_info(d: Path) -> dict:
    return json.loads((d / "fixture.json").read_text())


def read(d: Path):
    from llmjp_ds.checkpoint.megatron_reader import read as read_megatron

    return read_megatron(d / "save")


def config_of(info: dict):
    from llmjp_ds.model.shapes import model_config

    return model_config("tiny", hidden_size=info["hidden_size"], num_layers=info["num_layers"],
                        num_attention_heads=info["num_attention_heads"], num_key_value_heads=info["num_query_groups"],
                        ffn_hidden_size=info["ffn_hidden_size"], vocab_size=info["vocab_size"],
                        seq_len=info["seq_length"])


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
    assert len(ours) == 3 + 6 * info["num_layers"]
    assert ckpt.optimizer is not None and ckpt.optimizer.keys() == ckpt.weights.keys()
    for name, weight in ckpt.weights.items():
        state = ckpt.optimizer[name]
        assert {k: v.shape for k, v in state.items()} == {k: weight.shape for k in ("param", "exp_avg", "exp_avg_sq")}
        assert torch.equal(state["param"].to(weight.dtype), weight), name  # megatron-core copies master -> model
        if "make_fixtures.py" in info["made_by"]:  # every element got a gradient there: none left at zero
            assert (state["exp_avg_sq"] > 0).all(), name


def reference_of(d: Path) -> Path | None:
    """The fixture's own ``reference.pt``, or the canonical fixture's for the fixtures made with it (the same
    model, every layout started from the same weights by make_fixtures.py)."""
    if (d / "reference.pt").is_file():
        return d / "reference.pt"
    same = ("made_by", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
            "vocab_size", "iteration")
    if all(fixture_info(d).get(k) == fixture_info(CANONICAL).get(k) for k in same):
        return CANONICAL / "reference.pt"
    return None


REFERENCED = [d for d in DIRS if reference_of(d)]


@pytest.mark.parametrize("d", REFERENCED, ids=[d.name for d in REFERENCED])
def test_every_layout_carries_megatron_cores_optimizer_state(d):
    """Each parameter's master weight and moments, TP-merged and renumbered, are those megatron-core's optimizer
    holds for that parameter (its fingerprints): a moment on the wrong parameter, a wrong bucket offset, a
    plain split of fc1 or a stage's layers out of place would each change them."""
    reference = torch.load(reference_of(d))["fingerprints"]
    ckpt = read(d)
    for name, prints in reference.items():
        state = ckpt.optimizer[ma.canonical_name(name)]
        for key, expected in prints.items():
            assert torch.allclose(fingerprint(state[key]), expected, rtol=1e-6, atol=1e-9), (name, key)


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
    overrides = (f"{{hidden_size: {info['hidden_size']}, num_layers: {info['num_layers']}, num_attention_heads: "
                 f"{info['num_attention_heads']}, num_key_value_heads: {info['num_query_groups']}, ffn_hidden_size: "
                 f"{info['ffn_hidden_size']}, vocab_size: {info['vocab_size']}, seq_len: {info['seq_length']}}}")
    return [f"model.overrides={overrides}", f"data.tokenizer={small_tokenizer(tmp_path / 'sp')}",
            f"data.blend=[{prefix}]", f"data.seq_len={info['seq_length']}",
            f"train.global_batch_size={info['global_batch_size']}",
            f"train.micro_batch_size={info['global_batch_size']}", "train.steps=20", "precision.dtype=fp32",
            "model.z_loss=0", "logging.wandb=disabled", "train.eval_interval=0", "checkpoint.async_save=false",
            "model.backend=torch"]


def test_import_writes_a_run_at_megatrons_iteration(tmp_path):
    from llmjp_ds.checkpoint.megatron import import_megatron
    from llmjp_ds.config import load_config

    info = fixture_info(CANONICAL)
    out = import_megatron(CANONICAL / "save", tmp_path / "run", sets=import_sets(tmp_path, info))
    cfg = load_config(tmp_path / "run" / "config.yaml")
    assert (out["step"], out["consumed_samples"]) == (3, 24)
    assert (cfg.optim.schedule, cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.decay_steps) == \
        ("megatron", 1e-2, 2, 10)
    assert cfg.optim.min_lr_ratio == pytest.approx(0.1) and cfg.optim.clip_grad == 0.0
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "step00000003"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".run.")]  # nothing left beside it


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
    from llmjp_ds.checkpoint.megatron import import_megatron

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
    from llmjp_ds.checkpoint.megatron_dist_optim import unflatten

    whole = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)
    grid = torch.stack([torch.stack([whole[i * 2:(i + 1) * 2, j * 3:(j + 1) * 3].flatten() for j in range(2)])
                        for i in range(2)])  # [2, 2, 6]
    assert torch.equal(unflatten(grid, (4, 6), "k"), whole)
    assert unflatten(whole, (4, 6), "k") is whole


def test_layers_of_each_stage_and_chunk():
    from llmjp_ds.checkpoint.megatron_dist_optim import stage_layers

    args = dict
    assert stage_layers(args(num_layers=8, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)) \
        == [[range(0, 2), range(2, 4)], [range(4, 6), range(6, 8)]]
    uneven = args(num_layers=7, pipeline_model_parallel_size=3, decoder_first_pipeline_num_layers=1)
    assert stage_layers(uneven) == [[range(0, 1), range(1, 4), range(4, 7)]]
