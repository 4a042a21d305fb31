"""Tensor and sequence parallelism in the model, against the unsplit model.

* The shard layout (pure, no processes): ``tp_shard`` / ``tp_merge`` round-trip every kind of weight at TP 2
  and 4 and cut each where TE's layout says; the SwiGLU property that makes fc1's ``[gate_r; up_r]`` layout the
  right one (the per-rank MLPs sum to the whole MLP), and a naive dim-0 split that does not.
* Two gloo processes (one TP group of both): the vocabulary-parallel loss against ``causal_lm_loss`` of the
  whole logits (values and each rank's logit gradient), and a tiny model at TP2, with and without sequence
  parallelism, against the one-process model built from the same seed: loss, and every rank's gradient of
  every parameter against its shard of the one-process gradient. Without the sequence-parallel gradient sums the
  RMSNorm weights get only their sequence shard's part (the test shows the hook is what makes them right).
  HF ``forward`` at TP2 gives each rank its vocabulary slice of the logits, with batched ``position_ids`` too
  (RoPE angles ``[b, s, d]`` turned sequence-first like q and k).
* ``model.recompute: selective``: the attention core is recomputed in backward (counted), with bit-identical
  loss and gradients.

The two processes run once per module (``tp2``): every distributed case is computed in one spawn and checked by
the tests below, so the file stays fast on two cores.
"""

from __future__ import annotations

import datetime
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from llmjp_ds.model import model_config
from llmjp_ds.model.hf_adapter import tp_merge, tp_merge_state_dicts, tp_shard, tp_split_dim
from llmjp_ds.model.options import ModelOptions
from llmjp_ds.model.loss import IGNORE_INDEX, causal_lm_loss
from tests.launch import free_port

SEED = 1234
Z_LOSS = 1e-4
VOCAB = 64  # of the loss test: [s, b, V], each rank V / 2
LOSS_ATOL = 1e-6  # the vocabulary-parallel loss against the whole-row formula (fp32)
MODEL_ATOL = 1e-5  # TP2 model against the one-process model (fp32 loss and gradients)

NORMS = ("layernorm_qkv.layer_norm_weight", "layernorm_mlp.layer_norm_weight", "model.norm.weight")


def tiny_config(**kw):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, ffn_hidden_size=128,
                vocab_size=256, seq_len=64)
    return model_config("tiny", **{**base, **kw})


# --- shards, no processes -----------------------------------------------------------------------------------

def _full_state(config) -> dict[str, torch.Tensor]:
    """A random whole state dict of our names and shapes (every entry distinct, so a wrong cut shows)."""
    from llmjp_ds.model import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(config, backend="torch")
    return {k: torch.randn_like(v) if v.is_floating_point() else v for k, v in model.state_dict().items()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [2, 4])
def test_tp_shard_and_merge_cut_every_weight_where_te_does(size):
    heads, kv, d, h, ffn, vocab = 8, 4, 8, 64, 128, 256
    config = tiny_config(num_attention_heads=heads, num_key_value_heads=kv, hidden_size=h, ffn_hidden_size=ffn,
                         vocab_size=vocab)
    full = _full_state(config)
    shards = [{name: tp_shard(name, t, r, size) for name, t in full.items()} for r in range(size)]
    kinds = set()
    for name, tensor in full.items():
        parts = [s[name] for s in shards]
        assert torch.equal(tp_merge(name, parts), tensor), name  # the round trip is exact
        if name.endswith("_extra_state"):
            assert tp_split_dim(name) is None
            continue
        for r, part in enumerate(parts):
            if name.endswith(NORMS):
                kind, expected = "norm", tensor
            elif name.endswith("self_attention.layernorm_qkv.weight"):
                # whole KV groups: rank r holds groups [r kv/size, (r + 1) kv/size), each with its q heads, k, v
                g = kv // size
                kind, expected = "qkv", tensor.view(kv, heads // kv + 2, d, h)[r * g:(r + 1) * g].reshape(-1, h)
            elif name.endswith("self_attention.proj.weight"):
                kind, expected = "proj", tensor[:, r * heads * d // size:(r + 1) * heads * d // size]
            elif name.endswith("layernorm_mlp.fc1_weight"):
                gate, up = tensor[:ffn], tensor[ffn:]
                f = ffn // size
                kind, expected = "fc1", torch.cat([gate[r * f:(r + 1) * f], up[r * f:(r + 1) * f]])
            elif name.endswith("layernorm_mlp.fc2_weight"):
                kind, expected = "fc2", tensor[:, r * ffn // size:(r + 1) * ffn // size]
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                kind, expected = name, tensor[r * vocab // size:(r + 1) * vocab // size]
            else:
                raise AssertionError(f"a weight the test does not know: {name}")
            kinds.add(kind)
            assert torch.equal(part, expected), (name, r)
    assert kinds == {"norm", "qkv", "proj", "fc1", "fc2", "model.embed_tokens.weight", "lm_head.weight"}
    merged = tp_merge_state_dicts(shards)
    assert merged.keys() == full.keys()
    assert all(torch.equal(merged[k], full[k]) for k in full)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("size", [2, 4])
def test_per_rank_swiglu_mlps_sum_to_the_whole_mlp(size):
    """fc1 column-parallel, fc2 row-parallel: sum_r fc2_r(silu(gate_r x) * up_r x) is the whole MLP only if rank
    r's fc1 is [its gate rows; the matching up rows] (tp_shard). A contiguous dim-0 cut of fc1 pairs gate rows
    with gate rows (or up with up) and is not."""
    g = torch.Generator().manual_seed(size)
    h, ffn = 24, 40
    fc1 = torch.randn(2 * ffn, h, generator=g, dtype=torch.float64)
    fc2 = torch.randn(h, ffn, generator=g, dtype=torch.float64)
    x = torch.randn(7, h, generator=g, dtype=torch.float64)

    def mlp(w1, w2):
        gate, up = (x @ w1.T).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ w2.T

    whole = mlp(fc1, fc2)
    fc1_name, fc2_name = "model.layers.0.layernorm_mlp.fc1_weight", "model.layers.0.layernorm_mlp.fc2_weight"
    split = sum(mlp(tp_shard(fc1_name, fc1, r, size), tp_shard(fc2_name, fc2, r, size)) for r in range(size))
    torch.testing.assert_close(split, whole, atol=1e-12, rtol=1e-12)
    naive = sum(mlp(fc1.chunk(size, dim=0)[r], tp_shard(fc2_name, fc2, r, size)) for r in range(size))
    assert (naive - whole).abs().max() > 1e-2 * whole.abs().max()


# --- two gloo processes ---------------------------------------------------------------------------------------

def _loss_inputs(shift: float = 0.0):
    """Whole logits ``[s, b, V]`` and targets ``[b, s]`` with ignored positions and ids on both sides of the
    vocabulary split. ``shift`` moves every logit up: past 88.7, exp() overflows fp32 without the row maxima."""
    g = torch.Generator().manual_seed(SEED)
    s, b = 8, 3
    logits = 2 * torch.randn(s, b, VOCAB, generator=g) + shift
    targets = torch.randint(0, VOCAB, (b, s), generator=g)
    targets[0, :4] = torch.tensor([0, VOCAB // 2 - 1, VOCAB // 2, VOCAB - 1])
    targets[1, 2] = targets[2, 5] = targets[2, 7] = IGNORE_INDEX
    targets[0, 7] = IGNORE_INDEX
    return logits, targets


def _vocab_parallel_case(tp, z_loss: float, shift: float = 0.0) -> dict:
    from llmjp_ds.model.loss import CausalLMLoss, _vocab_parallel_terms

    logits, targets = _loss_inputs(shift)
    half = VOCAB // tp.size
    local = logits[..., tp.rank * half:(tp.rank + 1) * half].clone().requires_grad_()
    parts = _vocab_parallel_terms(local, targets, z_loss, tp)
    parts[0].backward()
    via_class = CausalLMLoss(z_loss, fused=False, tp=tp)(local.detach(), targets)
    whole = logits.clone().requires_grad_()
    ref = causal_lm_loss(whole.transpose(0, 1), targets, z_loss)
    ref.loss.backward()
    return {"tp": torch.stack([p.detach() for p in parts]), "class": torch.stack(list(via_class)),
            "ref": torch.stack([p.detach() for p in ref]), "grad": local.grad,
            "ref_grad": whole.grad[..., tp.rank * half:(tp.rank + 1) * half].clone()}


def _model_inputs(config):
    g = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(0, config.vocab_size, (2, 17), generator=g)
    targets = ids[:, 1:].clone()
    targets[0, 3] = targets[1, 0] = targets[1, 9] = IGNORE_INDEX
    return ids[:, :-1], targets


def _train_step(config, tp=None, hook: bool = True, recompute_core: bool = False) -> dict:
    from llmjp_ds.model import LlamaForCausalLM
    from llmjp_ds.parallel import build

    model = LlamaForCausalLM(config, backend="torch", z_loss_coeff=Z_LOSS, tp=tp,
                             options=ModelOptions(recompute="selective" if recompute_core else "none"))
    build.init_like_pipeline(model, config, "torch", SEED, False, tp)
    model.train()
    if hook:
        build.sum_sequence_parallel_grads(model, tp)
    ids, targets = _model_inputs(config)
    parts = model.training_loss(ids, targets)
    parts.loss.backward()
    return {"loss": torch.stack([p.detach() for p in parts]),
            "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()}}


def _forward_case(config, tp) -> dict:
    """HF ``forward`` in eval mode (logits ``[s, b, V / tp]``), with no positions and with batched ones."""
    from llmjp_ds.model import LlamaForCausalLM
    from llmjp_ds.parallel import build

    model = LlamaForCausalLM(config, backend="torch", tp=tp).eval()
    build.init_like_pipeline(model, config, "torch", SEED, False, tp)
    ids, _ = _model_inputs(config)
    out = {}
    with torch.no_grad():
        out["plain"] = model(ids).logits
        try:
            out["batched_positions"] = model(ids, position_ids=torch.arange(ids.shape[1]).expand_as(ids)).logits
        except Exception as exc:  # noqa: BLE001 - recorded for the test to report
            out["batched_positions"] = f"{type(exc).__name__}: {exc}"
        if tp is None:
            out["plain"] = out["plain"].transpose(0, 1)  # as the TP model's: sequence-first
    return out


def _tp2_worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from llmjp_ds.model.tensor_parallel import TensorParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        group = dist.new_group([0, 1])
        config = tiny_config()

        def tp(sp: bool) -> TensorParallel:
            return TensorParallel(group, 2, rank, sp)

        results = {
            "loss_z": _vocab_parallel_case(tp(False), Z_LOSS),
            "loss_no_z": _vocab_parallel_case(tp(False), 0.0),
            "loss_shifted": _vocab_parallel_case(tp(False), 0.0, shift=120.0),
            "reference": _train_step(config),
            "sp": _train_step(config, tp(True)),
            "no_sp": _train_step(config, tp(False)),
            "sp_selective": _train_step(config, tp(True), recompute_core=True),
            "sp_without_hook": _train_step(config, tp(True), hook=False),
            "forward_reference": _forward_case(config, None),
            "forward_sp": _forward_case(config, tp(True)),
        }
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier(group=group)
    except BaseException:
        (Path(out_dir) / f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """Both ranks' results of every distributed case (one spawn of two gloo processes)."""
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("tp2")
    ctx = mp.start_processes(_tp2_worker, args=(free_port(), str(out)), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + 100
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError("the two TP ranks did not finish within 100 s")
    except Exception as exc:  # each rank's own traceback (the first to end may only see its peer gone)
        errors = "\n".join(f"{p.name}:\n{p.read_text()}" for p in sorted(out.glob("*.error")))
        raise RuntimeError(f"the TP2 processes failed:\n{errors}") from exc
    finally:
        for proc in ctx.processes:  # only the two processes this fixture started
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", ["loss_z", "loss_no_z"])
def test_vocab_parallel_loss_matches_the_whole_rows(tp2, case):
    for rank, results in enumerate(tp2):
        r = results[case]
        print(f"[vocab-parallel loss {case} rank {rank}] max |d(loss, lm, z)| {_max_diff(r['tp'], r['ref']):.2e}, "
              f"max |dgrad| {_max_diff(r['grad'], r['ref_grad']):.2e}")
        torch.testing.assert_close(r["tp"], r["ref"], atol=LOSS_ATOL, rtol=0)
        torch.testing.assert_close(r["class"], r["tp"], atol=0, rtol=0)  # CausalLMLoss(tp=) takes this path
        torch.testing.assert_close(r["grad"], r["ref_grad"], atol=LOSS_ATOL, rtol=0)
        assert r["ref_grad"].abs().max() > 1e-3  # a gradient worth comparing
    if case == "loss_no_z":
        assert tp2[0][case]["tp"][2] == 0
    else:
        assert tp2[0][case]["ref"][2] > 0


@pytest.mark.timeout(150)
def test_vocab_parallel_loss_is_stable_for_large_logits(tp2):
    """Logits around 120 (exp overflows fp32): the all-reduced row maxima keep the log-sum-exp finite. The
    bound is looser than above: log Z ~ 120 carries fp32 rounding of 7.6e-6 before the target logit is
    subtracted."""
    for results in tp2:
        r = results["loss_shifted"]
        print(f"[vocab-parallel loss, logits ~120] max |d(loss, lm, z)| {_max_diff(r['tp'], r['ref']):.2e}, "
              f"max |dgrad| {_max_diff(r['grad'], r['ref_grad']):.2e}")
        assert torch.isfinite(r["tp"]).all() and torch.isfinite(r["grad"]).all()
        torch.testing.assert_close(r["tp"], r["ref"], atol=3e-5, rtol=0)
        torch.testing.assert_close(r["grad"], r["ref_grad"], atol=LOSS_ATOL, rtol=0)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", ["sp", "no_sp", "sp_selective"])
def test_tp2_model_matches_the_one_process_model(tp2, case):
    """Loss, and each rank's gradient of every parameter = its shard of the one-process gradient (the RMSNorm
    weights: the whole gradient on both ranks)."""
    ref = tp2[0]["reference"]
    assert torch.equal(ref["loss"], tp2[1]["reference"]["loss"])
    for rank, results in enumerate(tp2):
        r = results[case]
        assert r["grads"].keys() == ref["grads"].keys()
        loss_diff = _max_diff(r["loss"], ref["loss"])
        grad_diff = max(_max_diff(g, tp_shard(n, ref["grads"][n], rank, 2)) for n, g in r["grads"].items())
        print(f"[tp2 {case} rank {rank}] max |dloss| {loss_diff:.2e}, max |dgrad| {grad_diff:.2e}")
        torch.testing.assert_close(r["loss"], ref["loss"], atol=MODEL_ATOL, rtol=0)
        for name, grad in r["grads"].items():
            expected = tp_shard(name, ref["grads"][name], rank, 2)
            assert grad.shape == expected.shape, name
            if name.endswith(NORMS):
                assert tp_split_dim(name) is None and expected.shape == ref["grads"][name].shape
            torch.testing.assert_close(grad, expected, atol=MODEL_ATOL, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
            assert expected.abs().max() > 10 * MODEL_ATOL, name  # a gradient worth comparing


@pytest.mark.timeout(150)
def test_selective_recompute_under_tp_is_bit_identical(tp2):
    for results in tp2:
        assert torch.equal(results["sp_selective"]["loss"], results["sp"]["loss"])
        for name, grad in results["sp"]["grads"].items():
            assert torch.equal(results["sp_selective"]["grads"][name], grad), name


@pytest.mark.timeout(150)
def test_sequence_parallel_norm_grads_need_the_group_sum(tp2):
    """Without ``sum_sequence_parallel_grads`` each rank's RMSNorm weight gradient is its sequence shard's part:
    wrong on each rank, and the two parts add up to the whole gradient. The other weights do not depend on it."""
    ref = tp2[0]["reference"]["grads"]
    partial = [results["sp_without_hook"]["grads"] for results in tp2]
    norm_names = [n for n in ref if n.endswith(NORMS)]
    assert len(norm_names) == 2 * 2 + 1
    for name in norm_names:
        for rank in range(2):
            assert _max_diff(partial[rank][name], ref[name]) > 0.05 * ref[name].abs().max(), (name, rank)
        torch.testing.assert_close(partial[0][name] + partial[1][name], ref[name], atol=MODEL_ATOL, rtol=0)
    for rank in range(2):
        for name in ref:
            if name not in norm_names:
                torch.testing.assert_close(partial[rank][name], tp_shard(name, ref[name], rank, 2),
                                           atol=MODEL_ATOL, rtol=0)
        assert torch.equal(tp2[rank]["sp_without_hook"]["loss"], tp2[rank]["sp"]["loss"])


def _logit_shard(logits: torch.Tensor, rank: int) -> torch.Tensor:
    return logits.chunk(2, dim=-1)[rank]


@pytest.mark.timeout(150)
def test_tp2_forward_gives_this_ranks_vocabulary_slice_of_the_logits(tp2):
    ref = tp2[0]["forward_reference"]["plain"]
    for rank, results in enumerate(tp2):
        logits = results["forward_sp"]["plain"]
        print(f"[tp2 forward rank {rank}] max |dlogits| {_max_diff(logits, _logit_shard(ref, rank)):.2e}")
        torch.testing.assert_close(logits, _logit_shard(ref, rank), atol=MODEL_ATOL, rtol=0)


@pytest.mark.timeout(150)
def test_tp2_forward_with_batched_position_ids(tp2):
    ref = tp2[0]["forward_reference"]["plain"]
    for rank, results in enumerate(tp2):
        logits = results["forward_sp"]["batched_positions"]
        assert isinstance(logits, torch.Tensor), logits
        torch.testing.assert_close(logits, _logit_shard(ref, rank), atol=MODEL_ATOL, rtol=0)


# --- selective recompute, one process -------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_selective_recompute_recomputes_the_core_with_identical_results(monkeypatch):
    from llmjp_ds.model import LlamaForCausalLM
    from llmjp_ds.model.torch_layers import DotProductAttention

    config = tiny_config()
    calls = {"n": 0}
    attend = DotProductAttention._attend

    def counted(self, q, k, v):
        calls["n"] += 1
        return attend(self, q, k, v)

    monkeypatch.setattr(DotProductAttention, "_attend", counted)
    torch.manual_seed(SEED)
    state = LlamaForCausalLM(config, backend="torch").state_dict()
    ids, targets = _model_inputs(config)
    runs = {}
    for recompute in (False, True):
        model = LlamaForCausalLM(config, backend="torch", z_loss_coeff=Z_LOSS,
                                 options=ModelOptions(recompute="selective" if recompute else "none"))
        model.load_state_dict(state)
        model.train()
        assert all(layer.self_attention.recompute_core is recompute for layer in model.model.layers)
        calls["n"] = 0
        parts = model.training_loss(ids, targets)
        forward_calls = calls["n"]
        parts.loss.backward()
        runs[recompute] = (forward_calls, calls["n"] - forward_calls, torch.stack([p.detach() for p in parts]),
                           {n: p.grad for n, p in model.named_parameters()})
    layers = config.num_hidden_layers
    assert runs[False][:2] == (layers, 0)  # the core's activations are kept
    assert runs[True][:2] == (layers, layers)  # ... or it runs again in backward, once per layer
    assert torch.equal(runs[True][2], runs[False][2])
    for name, grad in runs[False][3].items():
        assert torch.equal(runs[True][3][name], grad), name
    # eval mode: nothing to recompute, the flag is inert
    model.eval()
    calls["n"] = 0
    with torch.no_grad():
        model.training_loss(ids, targets)
    assert calls["n"] == layers
