"""Expert parallelism on CPU over gloo: an MoE model's experts split over groups of data-parallel ranks, against the
same model on one process.

* The dispatch alone (no DeepSpeed): an MoE block whose experts are split over 4 ranks computes what the
  whole block computes on the same tokens, and its gradients are the whole block's (each rank's experts' own, the
  router's and norm's summed over the ranks), with experts that get no token at all.
* Training (``tiny-moe`` at the width of ``tests/runs.py``, fp32, 4 steps, the same seed, data and global batch):
  DP4 x EP4 (ZeRO-1) and DP4 x EP2 (ZeRO-2) follow the one-process EP1 run within the equivalence tolerances
  (loss, grad norm, router losses; the same expert loads), and end at its weights, read back from their
  checkpoints (DeepSpeed's MoE layout, one file per expert) and exported whole.
* DP2 x EP2 stopped at step 2 and resumed repeats its uninterrupted run exactly; the same checkpoint resumed on
  DP4 x EP4 and on one process without EP (another EP size and data-parallel size: converted once) continues the
  one-process EP1 trail.
* A rank builds only its own experts, the same as the whole model's (seeded layer by layer, and from an HF
  directory).
* The refusals (a dense model, indivisible sizes, ZeRO-0/3, TP or PP with EP > 1) are the bad-input catalogue's
  (``tests/reliability/cases_config.py``); here validation is asked directly.

What the comparisons catch: an expert's gradient not summed over its expert-data-parallel ranks (the notes'
negative control moved the weights by 100 %), summed over the wrong group or scaled by the EP size (the grad norm
moves by that factor), a row sent to the wrong rank or regrouped under the wrong expert (the loss leaves the trail
at step 1), experts initialised differently from the one-process run's (step 1's loss), and a conversion that
puts an expert under another index (the resumed trail).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llmjp_ds import checkpoint
from llmjp_ds.errors import UserError
from llmjp_ds.metrics.record import read_metrics

from tests.launch import run_command, train_argv
from tests.reliability.test_bad_inputs import _files
from tests.runs import COMMON_SETS, cli, max_rel_diff, run_train, trail
from tests.train.test_equivalence import GRAD_NORM_RTOL, LOSS_RTOL

STEPS, HALF = 4, 2
MOE = ("model.shape=tiny-moe", f"optim.decay_steps={STEPS}")
LAYOUTS = {  # name -> (processes, extra --set values); the global batch (8) of tests/runs.py in every one
    "ep1": (1, ()),
    "dp4-ep4": (4, ("parallel.expert_parallel=4", "parallel.zero_stage=1")),
    "dp4-ep2-zero2": (4, ("parallel.expert_parallel=2", "parallel.zero_stage=2")),
    "dp2-ep2": (2, ("parallel.expert_parallel=2", "parallel.zero_stage=1")),
    # a pipeline holds every expert of its stage's MoE layers
    "pp2": (2, ("parallel.pipeline_stages=2", "parallel.zero_stage=1")),
    # or splits them over each stage's data-parallel ranks; the decoder layers split evenly, so each stage holds one
    "pp2-dp2-ep2": (4, ("parallel.pipeline_stages=2", "parallel.expert_parallel=2", "parallel.zero_stage=1",
                        "parallel.partition_method=type:DecoderLayerPipe")),
    "pp2-dp2": (4, ("parallel.pipeline_stages=2", "parallel.zero_stage=1")),
    # each MoE block recomputed in backward (Megatron-LM's --recompute-modules moe), through the stages' layers
    "pp2-recompute-moe": (2, ("parallel.pipeline_stages=2", "parallel.zero_stage=1", "model.recompute=moe")),
}
# final weights after 4 steps at the runs' LR (3e-3), each tensor's max |diff| over its max |value|: Adam
# normalises each weight's step, so a weight whose gradient is ~0 (an embedding row of a token not seen) moves by
# whatever sign fp32 summation noise gives it (measured 2.9e-5 here, 3e-4 at tiny-moe's own width); an expert's
# gradient left out of its expert-data-parallel sum moved the weights by 100 % in the same comparison
WEIGHT_RTOL = 1e-3


# --- the dispatch alone --------------------------------------------------------------------------------------

CONFIG = SimpleNamespace(hidden_size=16, num_experts=8, num_experts_per_tok=2, initializer_range=0.02,
                         moe_intermediate_size=8, num_hidden_layers=2, rms_norm_eps=1e-6)


def _dispatch_rank(rank: int, world: int, port: int, tokens: int, out) -> None:
    from llmjp_ds.model import moe
    from llmjp_ds.model import torch_layers as L
    from llmjp_ds.model.expert_parallel import ExpertParallel
    from llmjp_ds.model.hf_adapter import ep_local_name
    from llmjp_ds.model.options import ModelOptions

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        whole = moe.MoEBlock(CONFIG, L, ModelOptions())
        x = torch.randn(world, tokens, CONFIG.hidden_size)
        whole(x).square().sum().backward()
        ep = ExpertParallel(dist.new_group(list(range(world))), world, rank, f"ep_size_{world}")
        part = moe.MoEBlock(CONFIG, L, ModelOptions(), ep=ep)
        local = ep.local(CONFIG.num_experts)
        part.load_state_dict({ep_local_name(k, rank, local): v for k, v in whole.state_dict().items()
                              if ep_local_name(k, rank, local) is not None})
        y = part(x[rank:rank + 1])
        y.square().sum().backward()
        diffs = {"output": (y - whole(x)[rank:rank + 1]).abs().max().item()}
        mine = dict(part.named_parameters())
        for name, param in whole.named_parameters():
            local_name = ep_local_name(name, rank, local)
            if local_name is None:
                continue
            grad = mine[local_name].grad.clone()
            if "experts" not in name:  # replicated: each rank's part of the whole batch's gradient
                dist.all_reduce(grad)
            diffs[name] = ((grad - param.grad).abs().max() / param.grad.abs().max()).item()
        chosen = part.routed.tokens_per_expert.clone()
        dist.all_reduce(chosen)
        diffs["experts without tokens"] = int((chosen == 0).sum())
        out.put((rank, diffs))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_split_experts_compute_the_whole_blocks_output_and_gradients(world=4):
    """Four ranks of two experts each (EP2's dispatch runs in the trainings below), each routing its own sequence
    of 2 tokens: 4 rows a rank over 8 experts, so some experts get no row at all."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=_dispatch_rank, args=(r, world, port, 2, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    results = dict(out.get() for _ in range(world))
    assert all(r.pop("experts without tokens") > 0 for r in results.values())
    for rank, diffs in results.items():
        assert diffs.pop("output") <= 1e-6, rank
        assert len(diffs) == 2 + 2 * (CONFIG.num_experts // world)  # norm, router, this rank's experts
        worst = max(diffs, key=diffs.get)
        assert diffs[worst] <= 1e-5, f"rank {rank}: {worst}'s gradient differs by {diffs[worst]:.2e}"


def test_a_rank_starts_with_its_own_experts_of_the_whole_model(tmp_path):
    """Rank 1 of EP2 builds its layers from the seeds every layout uses (``init_like_pipeline``) and loads an HF
    directory (``model.init_from_hf``): its experts ``weight0..3`` are the whole model's experts 4..7 and every
    other weight is the whole model's. No process group: building and loading never communicate."""
    from llmjp_ds.model import LlamaForCausalLM
    from llmjp_ds.model.expert_parallel import ExpertParallel
    from llmjp_ds.model.hf_adapter import ep_local_name
    from llmjp_ds.model.shapes import model_config
    from llmjp_ds.parallel.build import init_like_pipeline, load_hf_into_layers

    config = model_config("tiny-moe", num_layers=2)
    ep = ExpertParallel(None, 2, 1, "ep_size_2")
    whole = LlamaForCausalLM(config, backend="torch")
    init_like_pipeline(whole, config, "torch", seed=7)
    part = LlamaForCausalLM(config, backend="torch", ep=ep)
    init_like_pipeline(part, config, "torch", seed=7, ep=ep)
    expected = {ep_local_name(k, 1, 4): v for k, v in whole.state_dict().items() if ep_local_name(k, 1, 4)}
    got = part.state_dict()
    assert sorted(got) == sorted(expected)
    assert not [k for k in got if not torch.equal(got[k], expected[k])]
    assert torch.equal(got["model.layers.1.moe.experts.linear_fc2.weight0"],
                       whole.state_dict()["model.layers.1.moe.experts.linear_fc2.weight4"])

    torch.manual_seed(1)
    hf = LlamaForCausalLM(config, backend="torch")  # other weights than the seeded ones
    hf.save_pretrained(tmp_path / "hf", dtype=torch.float32)
    decoder_layers = [(i + 1, layer) for i, layer in enumerate(part.model.layers)]  # pipeline layer indices
    load_hf_into_layers(decoder_layers, str(tmp_path / "hf"), config, ep=ep)
    expected = {ep_local_name(k, 1, 4): v for k, v in hf.state_dict().items() if ep_local_name(k, 1, 4)}
    got = {k: v for k, v in part.state_dict().items() if k.startswith("model.layers.")}
    assert len(got) > 16 and not [k for k in got if not k.endswith("_extra_state") and not torch.equal(
        got[k], expected[k])]


# --- the refusals ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sets,world,expected", [
    ({"parallel.expert_parallel": 2}, 2, "but model.shape tiny is dense"),
    ({"model.shape": "tiny-moe", "parallel.expert_parallel": 3}, 3, "8 experts are not divisible"),
    ({"model.shape": "tiny-moe", "parallel.expert_parallel": 4}, 2, "does not divide the data-parallel size 2"),
    ({"model.shape": "tiny-moe", "parallel.expert_parallel": 2, "parallel.zero_stage": 0}, 2, "not ZeRO-0"),
    ({"model.shape": "tiny-moe", "parallel.expert_parallel": 2, "parallel.zero_stage": 3}, 2, "not ZeRO-3"),
    ({"model.shape": "tiny-moe", "parallel.expert_parallel": 2, "parallel.tensor_parallel": 2}, 4,
     "has experts and parallel.tensor_parallel=2"),
    ({"model.shape": "tiny-moe", "parallel.tensor_parallel": 2}, 2, "has experts and parallel.tensor_parallel=2"),
    ({"model.shape": "tiny-moe", "parallel.expert_parallel": 4, "parallel.pipeline_stages": 2}, 4,
     "does not divide the data-parallel size 2"),
])
def test_unsupported_expert_parallel_layouts_are_refused(sets, world, expected, tmp_path):
    from llmjp_ds.config import build_config
    from llmjp_ds.validate import validate_run

    batches = {"micro_batch_size": 1, "global_batch_size": 12}
    cfg = build_config({"run_dir": str(tmp_path / "run"), "train": batches, **_nested(sets)})
    with pytest.raises(UserError, match=expected):
        validate_run(cfg, world_size=world)
    layout = validate_run(build_config({"run_dir": str(tmp_path / "run"), "train": batches, "model": {
        "shape": "tiny-moe"}, "parallel": {"expert_parallel": 2}}), world_size=2)
    assert layout.expert == 2 and layout.name == "PP1 x DP2 (EP2)"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_pipeline_stage_without_experts_is_refused_in_one_line(train_env, tmp_path):
    """tiny-moe's two decoder layers cut by training FLOPs (the default) leave the second stage the head alone:
    under expert parallelism every stage must hold experts (DeepSpeed's ZeRO reduces each optimizer group's norm
    over the stages; a stage without the experts' group hung in that reduction). Every rank refuses, naming the
    fix (each rank its line), nothing is trained, and the corpus and tokenizer it read come out byte-identical."""
    run_dir = tmp_path / "run"
    before = _files(train_env)
    sets = [s for s in LAYOUTS["pp2-dp2-ep2"][1] if not s.startswith("parallel.partition_method")]
    result = run_command(train_argv(run_dir, COMMON_SETS, *MOE, *sets, f"train.steps={STEPS}"), tmp_path / "train",
                         check=False, nproc=4, timeout=300)
    assert result.returncode != 0
    err = (tmp_path / "train.err").read_text()
    lines = [re.sub(r"^error: \[rank (\d)\] ", r"error: ", line) for line in err.splitlines()
             if line.startswith("error: ")]
    assert len(lines) == 4 and set(lines) == {
        "error: parallel.expert_parallel=2 with parallel.pipeline_stages=2: a stage of parallel.partition_method=flops "
        "holds no MoE layer, and DeepSpeed's ZeRO needs the experts' optimizer group on every stage; use "
        "parallel.partition_method=type:DecoderLayerPipe (decoder layers split evenly) or fewer stages"}, err[-2000:]
    assert not list(run_dir.glob("checkpoints/step*"))
    after = _files(train_env)
    assert not [p for p in before if after.get(p) != before[p]], "an existing file changed or was removed"


def _nested(sets: dict) -> dict:
    out: dict = {}
    for key, value in sets.items():
        section, name = key.split(".")
        out.setdefault(section, {})[name] = value
    return out


# --- training ------------------------------------------------------------------------------------------------

RESHAPES = {  # a checkpoint of step 2 of the first layout, resumed on the second
    "dp2-ep2-then-dp4-ep4": ("dp2-ep2", "dp4-ep4"),
    "dp2-ep2-then-ep1": ("dp2-ep2", "ep1"),
    "dp2-ep2-then-pp2-dp2-ep2": ("dp2-ep2", "pp2-dp2-ep2"),
    "pp2-dp2-ep2-then-ep1": ("pp2-dp2-ep2", "ep1"),
    "pp2-then-ep1": ("pp2", "ep1"),
}


@pytest.fixture(scope="module")
def ep_runs(train_env, tmp_path_factory):
    """Each layout's uninterrupted run; DP2 x EP2 and PP2 x DP2 (EP2) each stopped at ``HALF`` and resumed
    (``<layout>-resumed``), and each checkpoint of :data:`RESHAPES` resumed on another layout (copies of the
    stopped run's directory)."""
    root = tmp_path_factory.mktemp("expert-parallel")
    out = {name: run_train(root / name, nproc, *MOE, *sets, f"train.steps={STEPS}")
           for name, (nproc, sets) in LAYOUTS.items()}
    for name in {saved for saved, _ in RESHAPES.values()}:
        nproc, sets = LAYOUTS[name]
        run_train(root / f"{name}-resumed", nproc, *MOE, *sets, f"train.steps={HALF}")
        for reshape, (saved, _) in RESHAPES.items():
            if saved == name:
                shutil.copytree(root / f"{name}-resumed", root / reshape)
        out[f"{name}-resumed"] = run_train(root / f"{name}-resumed", nproc, *MOE, *sets, f"train.steps={STEPS}")
    for reshape, (_, then) in RESHAPES.items():
        nproc, sets = LAYOUTS[then]
        out[reshape] = run_train(root / reshape, nproc, *MOE, *sets, f"train.steps={STEPS}")
    return out


def _assert_follows(got: list[dict], ref: list[dict], name: str) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, STEPS + 1))
    assert [r["consumed_samples"] for r in got] == [r["consumed_samples"] for r in ref]
    rel = {key: max_rel_diff([r[key] for r in got], [r[key] for r in ref])
           for key in ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss")}
    print(f"\n{name} vs EP1: max rel diff " + ", ".join(f"{k} {v:.2e}" for k, v in rel.items()))
    assert rel["loss"] <= LOSS_RTOL and rel["moe_aux_loss"] <= LOSS_RTOL and rel["moe_z_loss"] <= LOSS_RTOL, rel
    assert rel["grad_norm"] <= GRAD_NORM_RTOL, rel


def _final_weights(run_dir) -> dict[str, torch.Tensor]:
    tag = checkpoint.latest_tag(run_dir)
    state = checkpoint.read_model_state(run_dir, tag, checkpoint.read_marker(run_dir, tag))
    return {k: v for k, v in state.items() if not k.endswith("_extra_state")}


def _assert_same_final_weights(run_dir, ref_dir, name: str) -> None:
    ours, theirs = _final_weights(run_dir), _final_weights(ref_dir)
    assert sorted(ours) == sorted(theirs)
    worst = max(((ours[k] - theirs[k]).abs().max() / theirs[k].abs().max()).item() for k in theirs)
    print(f"{name}: final weights' max rel diff {worst:.2e}")
    assert worst <= WEIGHT_RTOL


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("layout", ["dp4-ep4", "dp4-ep2-zero2"])
def test_expert_parallel_follows_one_process(layout, ep_runs):
    ref, got = trail(ep_runs["ep1"]), trail(ep_runs[layout])
    _assert_follows(got, ref, layout)
    for key in ("moe_min_load", "moe_least_loaded", "moe_dropped_tokens"):  # the same tokens to the same experts
        assert [r[key] for r in got] == [r[key] for r in ref], key
    run_dir = ep_runs[layout]
    tag = checkpoint.latest_tag(run_dir)
    files = sorted(p.name for p in (checkpoint.checkpoint_dir(run_dir) / tag).glob("layer_*_expert_*"))
    assert files == sorted(f"layer_0_expert_{e}_mp_rank_00_model_states.pt" for e in range(8))
    assert checkpoint.read_marker(run_dir, tag).expert_parallel == int(layout.split("-ep")[1][0])
    _assert_same_final_weights(run_dir, ep_runs["ep1"], layout)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("layout", ["pp2", "pp2-dp2", "pp2-recompute-moe", "pp2-dp2-ep2"])
def test_a_pipeline_of_moe_layers_follows_one_process(layout, ep_runs):
    """Each stage trains its MoE layers' routers through their outputs' backward, and the step's routing is the
    stages' and data-parallel ranks' sum: the trail is the one-process run's (the router's losses, the same tokens
    to the same experts) and so are the final weights, with the MoE blocks recomputed in backward too, and with
    each stage's experts split over its data-parallel ranks (each stage's expert files under its model-parallel
    rank: one stage's files overwriting the other's would lose a layer's experts). Without the router losses'
    gradient on the first stage the z-loss moved by 5e-3 at step 2 and the loads by 9 tokens at step 4."""
    ref, got = trail(ep_runs["ep1"]), trail(ep_runs[layout])
    _assert_follows(got, ref, layout)
    for key in ("moe_min_load", "moe_least_loaded", "moe_dropped_tokens", "moe_layer_imbalance"):
        assert [r[key] for r in got] == [r[key] for r in ref], key
    if layout == "pp2-dp2-ep2":
        tag = checkpoint.latest_tag(ep_runs[layout])
        files = sorted(p.name for p in (checkpoint.checkpoint_dir(ep_runs[layout]) / tag).glob("layer_*_expert_*"))
        assert files == sorted(f"layer_0_expert_{e}_mp_rank_{s:02d}_model_states.pt" for e in range(8)
                               for s in range(2))
    _assert_same_final_weights(ep_runs[layout], ep_runs["ep1"], layout)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("reshape,saved,now", [("pp2-then-ep1", "PP2 x DP1", "PP1 x DP1"),
                                               ("pp2-dp2-ep2-then-ep1", "PP2 x DP2 (EP2)", "PP1 x DP1"),
                                               ("dp2-ep2-then-pp2-dp2-ep2", "PP1 x DP2 (EP2)", "PP2 x DP2 (EP2)")])
def test_a_pipelines_moe_checkpoint_continues_on_another_layout(ep_runs, reshape, saved, now):
    """A pipeline's checkpoint of step 2 (its experts whole on each stage, or split over its data-parallel ranks)
    continued on one process, and an expert-parallel one continued on a pipeline that splits its experts: the
    one-process trail goes on."""
    run_dir = ep_runs[reshape]
    _assert_follows(trail(run_dir), trail(ep_runs["ep1"]), f"{saved} then {now}")
    events = [r for r in read_metrics(run_dir) if r.get("event") == "reshape"]
    assert [(e["step"], e["saved"], e["now"]) for e in events] == [(HALF, saved, now)]


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("layout", ["dp4-ep2-zero2", "pp2-dp2-ep2"])
def test_export_of_an_expert_parallel_checkpoint_is_the_whole_model(ep_runs, layout, tmp_path):
    """Layer 1's expert 5 lives in the second expert-parallel rank's files (of stage 1 under the pipeline)."""
    run_dir = ep_runs[layout]
    out = tmp_path / "hf"
    result = cli(["export", "--run", str(run_dir), "--output", str(out), "--dtype", "fp32"], tmp_path / "export")
    assert "AutoModelForCausalLM reload check passed" in result.stdout, result.stdout
    from safetensors.torch import load_file

    exported = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert {f"model.layers.{i}.mlp.experts.{e}.down_proj.weight" for i in range(2) for e in range(8)} <= set(exported)
    whole = _final_weights(run_dir)
    assert torch.equal(exported["model.layers.1.mlp.experts.5.down_proj.weight"],
                       whole["model.layers.1.moe.experts.linear_fc2.weight5"])


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("layout", ["dp2-ep2", "pp2", "pp2-dp2-ep2"])
def test_resume_with_expert_parallelism_is_exact(ep_runs, layout):
    full, resumed = trail(ep_runs[layout]), trail(ep_runs[f"{layout}-resumed"])
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for key in ("loss", "z_loss", "lr", "grad_norm", "consumed_samples", "moe_aux_loss", "moe_min_load"):
        assert [r[key] for r in resumed] == [r[key] for r in full], f"{key} differs after resuming at step {HALF}"
    a, b = _final_weights(ep_runs[layout]), _final_weights(ep_runs[f"{layout}-resumed"])
    assert sorted(a) == sorted(b)
    assert not [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("then,name", [("dp4-ep4", "PP1 x DP4 (EP4)"), ("ep1", "PP1 x DP1")])
def test_a_checkpoint_resumes_on_another_expert_and_data_parallel_size(ep_runs, then, name):
    """DP2 x EP2's checkpoint of step 2 on DP4 x EP4, and on one process without EP: each expert moves to the rank
    that holds it now, with its Adam moments, and the trail goes on as the one-process EP1 run's."""
    run_dir = ep_runs[f"dp2-ep2-then-{then}"]
    _assert_follows(trail(run_dir), trail(ep_runs["ep1"]), f"DP2 x EP2 then {name}")
    events = [r for r in read_metrics(run_dir) if r.get("event") == "reshape"]
    assert [(e["step"], e["saved"], e["now"]) for e in events] == [(HALF, "PP1 x DP2 (EP2)", name)]
