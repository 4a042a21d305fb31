"""The one-pass optimizer step (``optim.fused_step``, :mod:`llmjp_ds.model.kernels.adamw` wired in by
``parallel.deepspeed_internals.fuse_optimizer_step``) against what it replaces: DeepSpeed's clip, torch's AdamW
and the bf16 copy of the master weights.

* The kernel alone: several steps of one flat partition (a length that is no multiple of the block), clipped and
  not, with and without weight decay, against ``torch.optim.AdamW`` stepping the clipped gradient (fused on
  CUDA, foreach on the CPU).
* Through DeepSpeed: a tiny Llama (the torch backend on a CPU, TE on the H200) under ``BF16_Optimizer`` (bf16,
  ZeRO-1, fp32 accumulation, ``parallel.build.initialize``) with and without the fused step, the same batches:
  the same first step to the bit, losses and gradient norms close step by step, weight updates and second moments
  that agree as a whole, bf16 weights that are the master weights rounded, a step with a non-finite gradient
  skipped by both,
  and checkpoints of the same form (torch's AdamW state); and over two data-parallel ranks (ZeRO-1, gloo), where
  each rank steps its partition and the all-gather must hand every rank the others' bf16 weights.

On a CPU with Triton installed the kernel runs under Triton's interpreter (in a fresh process: Triton reads the
switch once); on the H200 the same checks run on CUDA (``-m gpu``).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tests.launch import free_port
from tests.model.test_kernel_rope import interpreted

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                                reason="needs CUDA and Triton (run on the H200)")
cpu_with_triton = pytest.mark.skipif(torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                                     reason="the interpreter check is for CPU machines with Triton installed")

N = 5 * 2048 + 77  # several programs and a ragged tail


def _to_bf16(x: torch.Tensor, interpreter: bool) -> torch.Tensor:
    if interpreter:
        return (x.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    return x.to(torch.bfloat16)


def _kernel_against_torch(device: str) -> None:
    from llmjp_ds.model.kernels import adamw

    for clip_at, weight_decay in ((1.0, 0.1), (0.0, 0.0), (50.0, 0.1)):
        torch.manual_seed(0)
        param = torch.randn(N, device=device)
        ref = param.clone().requires_grad_(True)
        opt = torch.optim.AdamW([ref], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay,
                                **({"fused": True} if device == "cuda" else {"foreach": True}))
        state, group = {}, opt.param_groups[0]
        lowp = torch.empty(N, device=device, dtype=torch.bfloat16)
        clipped = []
        for step in range(4):
            grad = torch.randn(N, device=device) * (0.005 if step == 2 else 1.0)  # norms ~100, 0.5 at step 2
            norm = grad.norm()
            clip = adamw.clip_factor(norm, clip_at)
            coef = clip_at / (norm + 1e-6)  # DeepSpeed's clip_tensors_by_global_norm
            ref.grad = grad * coef if clip_at > 0 and coef < 1 else grad.clone()
            clipped.append(bool(clip_at > 0 and coef < 1))
            opt.step()
            adamw.adamw_step_(param, grad.clone(), state, lowp, group, clip)
            want = ref.detach()
            worst = (param - want).abs().max().item()
            print(f"[fused adamw] clip {clip_at} wd {weight_decay} step {step}: max |diff| {worst:.2e}")
            torch.testing.assert_close(param, want, rtol=2e-6, atol=1e-7)
            for key in ("exp_avg", "exp_avg_sq"):  # near-cancelling moments: fp32 rounding of the largest
                want_moment = opt.state[ref][key]
                torch.testing.assert_close(state[key], want_moment, rtol=2e-6,
                                           atol=2e-7 * want_moment.abs().max().item())
            assert state["step"].item() == opt.state[ref]["step"].item() == step + 1
            assert state["step"].dtype == opt.state[ref]["step"].dtype
            # the bf16 copy is the updated fp32 weight rounded to nearest even (Triton's interpreter truncates
            # instead), at most one bf16 step from torch's rounding of its own weight
            assert torch.equal(lowp, _to_bf16(param, interpreter=device == "cpu"))
            torch.testing.assert_close(lowp.float(), want.to(torch.bfloat16).float(), rtol=8e-3, atol=0)
        assert clipped == ([True, True, False, True] if clip_at else [False] * 4)


@pytest.mark.parametrize("max_norm", [1.0, 0.0])
@pytest.mark.parametrize("norm", [0.25, 1.0 - 1e-6, 1.0, 3.0, 1e4])
def test_clip_factor_is_deepspeeds_clip(norm, max_norm):
    """The factor the kernel multiplies by gives DeepSpeed's clipped gradient to the bit (fp32, on the CPU)."""
    from deepspeed.runtime.utils import clip_tensors_by_global_norm

    from llmjp_ds.model.kernels import adamw

    grads = [torch.randn(1000, generator=torch.Generator().manual_seed(0)), torch.randn(7)]
    norm_t = torch.tensor(norm)
    want = [g.clone() for g in grads]
    if max_norm > 0:  # DeepSpeed's BF16_Optimizer clips only when clip_grad > 0
        clip_tensors_by_global_norm(want, max_norm=max_norm, global_norm=norm_t)
    factor = adamw.clip_factor(norm_t, max_norm)
    assert factor.dtype == torch.float32 and factor.dim() == 0
    for g, w in zip(grads, want):
        assert torch.equal(g * factor, w)


def check_kernel_under_the_interpreter():
    _kernel_against_torch("cpu")


@cpu_with_triton
def test_kernel_matches_torch_adamw_under_the_interpreter():
    interpreted("check_kernel_under_the_interpreter", __name__)


@pytest.mark.gpu
@needs_cuda
def test_kernel_matches_torch_fused_adamw():
    _kernel_against_torch("cuda")


# --- through DeepSpeed's BF16_Optimizer --------------------------------------------------------------------------

GAS, MICRO, SEQ, STEPS = 2, 2, 16, 4


def _engine_run(fused: bool, device: str, clip: float, nan_step: int | None = None, data: int = 1) -> dict:
    from llmjp_ds.config import load_config
    from llmjp_ds.model import LlamaForCausalLM
    from llmjp_ds.model.shapes import model_config
    from llmjp_ds.parallel.build import initialize
    from llmjp_ds.parallel.deepspeed_internals import fuse_optimizer_step
    from llmjp_ds.parallel.layout import Layout

    cfg = load_config(None, ["precision.dtype=bf16", "parallel.zero_stage=1", f"train.micro_batch_size={MICRO}",
                             f"train.global_batch_size={MICRO * GAS * data}", "optim.lr=0.01", "optim.warmup_steps=0",
                             f"optim.clip_grad={clip}", f"optim.fused_step={str(fused).lower()}",
                             "logging.wandb=disabled"], "demo")
    config = model_config("tiny", hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          ffn_hidden_size=128, vocab_size=512, seq_len=SEQ)
    torch.manual_seed(0)
    backend = "te" if device == "cuda" else "torch"
    model = LlamaForCausalLM(config, backend=backend, z_loss_coeff=1e-4)
    rank = torch.distributed.get_rank()
    engine = initialize(cfg, model, Layout(data))
    opt = engine.optimizer
    if fused and device == "cpu":  # initialize fuses on CUDA only; the interpreter runs the kernel on the CPU
        assert fuse_optimizer_step(opt)
    out = {"replaced": "step" in vars(opt), "losses": [], "norms": [], "applied": [],
           "initial": [m.detach().cpu().clone() for m in opt.fp32_groups_flat_partition]}
    # each data-parallel rank its own batches
    ids = torch.randint(0, 512, (STEPS, GAS, MICRO, SEQ + 1), generator=torch.Generator().manual_seed(1 + rank))
    for s in range(STEPS):
        for m in range(GAS):
            inp, tgt = ids[s, m, :, :-1].to(device), ids[s, m, :, 1:].to(device)
            loss = engine(input_ids=inp, shift_labels=tgt).loss
            engine.backward(loss * float("nan") if s == nan_step else loss)
            out["losses"].append(loss.item())
            engine.step()
        out["norms"].append(float(engine.get_global_grad_norm()))
        out["applied"].append(engine.was_step_applied())
    out["lowp"] = [flat.detach().cpu().clone() for flat in opt.bf16_groups_flat]
    out["partitions"] = [len(parts) for parts in opt.bf16_partitioned_groups]
    out["masters"] = [m.detach().cpu().clone() for m in opt.fp32_groups_flat_partition]
    state = opt.state_dict()["base_optimizer_state"]
    out["state_keys"] = sorted((k, tuple(sorted(v))) for k, v in state["state"].items())
    out["state_steps"] = [(str(v["step"].dtype), v["step"].device.type, v["step"].item())
                          for v in state["state"].values()]
    out["moments"] = [v["exp_avg_sq"].cpu().clone() for v in state["state"].values()]
    return out


def _engines_agree(device: str) -> None:
    from llmjp_ds.model.kernels import adamw
    from llmjp_ds.parallel.context import init_distributed

    if device == "cpu":  # the interpreter runs the kernel on CPU tensors
        adamw.supported = lambda param: param.dtype == torch.float32 and param.is_contiguous()
    if not torch.distributed.is_initialized():
        for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(free_port())}.items():
            os.environ.setdefault(key, value)
        init_distributed()
    for clip, nan_step in ((0.05, None), (0.0, 2)):
        runs = {fused: _engine_run(fused, device, clip, nan_step) for fused in (False, True)}
        ds, ours = runs[False], runs[True]
        assert not ds["replaced"] and ours["replaced"]
        print(f"[fused step, {device}, clip {clip}] losses {ds['losses']} vs {ours['losses']}; norms {ds['norms']} "
              f"vs {ours['norms']}")
        assert ours["applied"] == ds["applied"] == [s != nan_step for s in range(STEPS)]
        assert ours["losses"][:GAS] == ds["losses"][:GAS]  # the same first step, to the bit
        # later steps start from weights that agree to fp32 rounding, then bf16 rounding
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ds["losses"]), rtol=2e-3, atol=0)
        finite = [s for s in range(STEPS) if s != nan_step]
        torch.testing.assert_close(torch.tensor([ours["norms"][s] for s in finite]),
                                   torch.tensor([ds["norms"][s] for s in finite]), rtol=2e-2, atol=0)
        if clip:
            assert min(ds["norms"]) > clip  # every step clipped
        # Adam moves a weight by about lr whatever its gradient's size, so a gradient near zero whose sign a
        # rounding flips moves it the other way: the updates agree as a whole (a forgotten clip or bias
        # correction shows in the moments below, and in the kernel's own test)
        for a, b, start in zip(ours["masters"], ds["masters"], ds["initial"]):
            assert ((a - b).norm() / (b - start).norm()).item() < 0.05
        # the model's bf16 weights are the master weights rounded, written by the kernel (one process: the
        # partition is the whole group)
        for run, interpreter in ((ds, False), (ours, device == "cpu")):
            for lowp, master in zip(run["lowp"], run["masters"]):
                assert torch.equal(lowp, _to_bf16(master, interpreter))
        assert ours["state_keys"] == ds["state_keys"] and ours["state_steps"] == ds["state_steps"]
        # the second moments, of the clipped gradients (a forgotten clip would make them ~1000x larger here); the
        # interpreter's truncated bf16 weights take the gradients further apart than rounded ones
        for a, b in zip(ours["moments"], ds["moments"]):
            assert ((a - b).norm() / b.norm()).item() < (0.15 if device == "cpu" else 0.05)


def check_engines_under_the_interpreter():
    _engines_agree("cpu")


@cpu_with_triton
def test_deepspeed_step_fused_and_not_agree_under_the_interpreter():
    interpreted("check_engines_under_the_interpreter", __name__)


@pytest.mark.gpu
@needs_cuda
def test_deepspeed_step_fused_and_not_agree():
    _engines_agree("cuda")


# --- two data-parallel ranks: each steps its partition, the all-gather hands the other ranks' bf16 weights over --

def _two_rank_worker(rank: int, port: int, out_dir: str) -> None:
    from llmjp_ds.model.kernels import adamw
    from llmjp_ds.parallel.context import init_distributed

    adamw.supported = lambda param: param.dtype == torch.float32 and param.is_contiguous()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    init_distributed()
    runs = {fused: _engine_run(fused, "cpu", 0.05, data=2) for fused in (False, True)}
    torch.save(runs, os.path.join(out_dir, f"rank{rank}.pt"))


def check_two_ranks_under_the_interpreter():
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_two_rank_worker, args=(free_port(), out_dir), nprocs=2, start_method="spawn")
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    for fused in (False, True):
        a, b = ranks[0][fused], ranks[1][fused]
        assert a["partitions"] == b["partitions"] == [2] * len(a["partitions"])  # ZeRO-1 over two ranks
        assert a["replaced"] is fused
        # after the all-gather every rank holds every rank's updated bf16 weights
        for x, y in zip(a["lowp"], b["lowp"]):
            assert torch.equal(x, y)
        assert a["losses"] != b["losses"]  # each rank its own batches
    ds, ours = ranks[0][False], ranks[0][True]
    print(f"[fused step, 2 ranks] losses {ds['losses']} vs {ours['losses']}")
    assert ours["losses"][:GAS] == ds["losses"][:GAS]
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ds["losses"]), rtol=2e-3, atol=0)
    for rank in ranks:  # each rank's master partition moved as DeepSpeed moves it
        for a, b, start in zip(rank[True]["masters"], rank[False]["masters"], rank[False]["initial"]):
            assert ((a - b).norm() / (b - start).norm()).item() < 0.05


@cpu_with_triton
def test_two_data_parallel_ranks_fused_and_not_agree_under_the_interpreter():
    interpreted("check_two_ranks_under_the_interpreter", __name__)
