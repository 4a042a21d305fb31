"""The pure-PyTorch backend reproduces Transformer Engine's layout; on a GPU with TE both backends agree.

The CPU half checks the layout against TE's own naming (as ``te.TransformerLayer`` names its modules) and the
math of each fused op against a plain formula. The GPU half (run on the H200) builds the TE backend, checks
HF parity there and moves state dicts between the backends in both directions.
"""

from __future__ import annotations

import pytest
import torch

from llmjp_ds.model import LlamaForCausalLM, model_config
from llmjp_ds.model.hf_adapter import fuse_qkv, split_qkv

TE_LAYER_KEYS = {  # what te.TransformerLayer(fuse_qkv_params=True, normalization="RMSNorm", bias=False) holds
    "self_attention.layernorm_qkv.layer_norm_weight", "self_attention.layernorm_qkv.weight",
    "self_attention.layernorm_qkv._extra_state", "self_attention.core_attention._extra_state",
    "self_attention.proj.weight", "self_attention.proj._extra_state",
    "layernorm_mlp.layer_norm_weight", "layernorm_mlp.fc1_weight", "layernorm_mlp.fc2_weight",
    "layernorm_mlp._extra_state",
}


def small_config(**kw):
    base = dict(hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2, ffn_hidden_size=96,
                vocab_size=256, seq_len=64)
    return model_config("tiny", **{**base, **kw})


def test_torch_backend_uses_te_names_and_shapes():
    config = small_config()
    model = LlamaForCausalLM(config, backend="torch")
    layer0 = {k[len("model.layers.0."):]: v for k, v in model.state_dict().items() if k.startswith("model.layers.0.")}
    assert set(layer0) == TE_LAYER_KEYS
    assert layer0["self_attention.layernorm_qkv.weight"].shape == ((4 + 2 * 2) * 16, 64)
    assert layer0["layernorm_mlp.fc1_weight"].shape == (2 * 96, 64)
    assert layer0["layernorm_mlp.fc2_weight"].shape == (64, 96)


def test_qkv_interleaving_is_per_kv_group():
    config = small_config()
    d, h = 16, 64
    q = torch.arange(4 * d * h, dtype=torch.float32).view(4 * d, h)
    k = -torch.arange(2 * d * h, dtype=torch.float32).view(2 * d, h) - 1
    v = k - 10_000
    fused = fuse_qkv(q, k, v, config).view(2, 4, d, h)  # [groups, q heads of group + k + v, d, h]
    assert torch.equal(fused[0, 0], q[:d]) and torch.equal(fused[0, 1], q[d:2 * d])
    assert torch.equal(fused[0, 2], k[:d]) and torch.equal(fused[0, 3], v[:d])
    assert torch.equal(fused[1, 0], q[2 * d:3 * d]) and torch.equal(fused[1, 2], k[d:])
    for a, b in zip(split_qkv(fused.view(-1, h), config), (q, k, v)):
        assert torch.equal(a, b)


def test_swiglu_gates_the_first_half_of_fc1():
    from llmjp_ds.model.torch_layers import LayerNormMLP

    mlp = LayerNormMLP(8, 5, eps=1e-5, init_std=0.5, output_std=0.5)
    x = torch.randn(3, 8)
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    gate, up = mlp.fc1_weight[:5], mlp.fc1_weight[5:]
    expected = (torch.nn.functional.silu(n @ gate.T) * (n @ up.T)) @ mlp.fc2_weight.T
    torch.testing.assert_close(mlp(x), expected)


def test_extra_state_round_trips_opaquely():
    config = small_config()
    a = LlamaForCausalLM(config, backend="torch")
    state = a.state_dict()
    blob = torch.tensor([1, 2, 3], dtype=torch.uint8)
    state["model.layers.1.layernorm_mlp._extra_state"] = blob
    b = LlamaForCausalLM(config, backend="torch")
    b.load_state_dict(state, strict=True)
    assert torch.equal(b.state_dict()["model.layers.1.layernorm_mlp._extra_state"], blob)


def test_activation_checkpointing_gives_identical_gradients():
    from llmjp_ds.model.options import ModelOptions

    config = small_config()
    ids = torch.randint(0, 256, (2, 32))
    grads = []
    for recompute in ("none", "full"):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config, backend="torch", options=ModelOptions(recompute=recompute)).train()
        assert model.activation_checkpointing is (recompute == "full")
        model.training_loss(ids[:, :-1], ids[:, 1:]).loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for g0, g1 in zip(*grads):
        torch.testing.assert_close(g0, g1, atol=0, rtol=0)


needs_te = pytest.mark.skipif(
    not torch.cuda.is_available() or not __import__("llmjp_ds.model.backend", fromlist=["x"]).te_importable(),
    reason="needs CUDA and Transformer Engine (run on the H200)")


@pytest.mark.gpu
@needs_te
@pytest.mark.parametrize("shape", ["gqa", "mha", "odd"])
def test_te_backend_matches_hf_in_fp32_and_bf16(shape, tmp_path):
    import transformers

    from tests.conftest import PARITY_SHAPES

    config = model_config("tiny", **{**PARITY_SHAPES[shape], "vocab_size": 512})
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    ids = torch.randint(0, 512, (2, 32))
    with torch.no_grad():
        ref = hf(ids, labels=ids)
    ours = LlamaForCausalLM.from_pretrained(tmp_path / "hf", backend="te").eval()
    with torch.no_grad():
        out = ours(ids.cuda(), labels=ids.cuda())
    fp32_err = (out.logits.float().cpu() - ref.logits).abs().max().item()
    # TE computes FP32 models with TF32 tensor-core GEMMs and has no switch to turn that off: measured on the H200,
    # TE vs exact fp32 is 2.4-3.0e-4 (HF itself on the GPU with TF32 on is no closer), so the bound is TF32's.
    print(f"[te parity {shape}] fp32 max |dlogits| vs exact fp32: {fp32_err:.2e}")
    assert fp32_err <= 1e-3
    # bf16: both models in bf16 against the fp32 reference; TE must be no worse than HF's own bf16 (+ slack)
    hf16 = hf.to(torch.bfloat16).cuda()
    ours16 = LlamaForCausalLM.from_pretrained(tmp_path / "hf", backend="te", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        hf_err = (hf16(ids.cuda()).logits.float().cpu() - ref.logits).abs().max().item()
        te_err = (ours16(ids.cuda()).logits.float().cpu() - ref.logits).abs().max().item()
    print(f"[te parity {shape}] bf16 max |dlogits|: te {te_err:.2e}, hf {hf_err:.2e}")
    assert te_err <= max(2 * hf_err, 2e-2)
    gen_ref = hf.float().generate(ids[:, :5].cuda(), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                                  pad_token_id=0)
    gen = ours.generate(ids[:, :5].cuda(), max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(gen.cpu(), gen_ref.cpu())


@pytest.mark.gpu
@needs_te
@pytest.mark.parametrize("fp8_lm_head", [False, True])  # the head as nn.Linear, or as TE's Linear
def test_state_dicts_move_between_te_and_torch_backends(fp8_lm_head):
    config = small_config(vocab_size=512)
    torch.manual_seed(0)
    te_model = LlamaForCausalLM(config, backend="te", fp8_lm_head=fp8_lm_head).eval()
    ids = torch.randint(0, 512, (2, 32))
    state = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in te_model.state_dict().items()}
    assert ("lm_head._extra_state" in state) is fp8_lm_head
    cpu_model = LlamaForCausalLM(config, backend="torch", fp8_lm_head=fp8_lm_head).eval()
    cpu_model.load_state_dict(state, strict=True)  # TE-made state dict on the CPU twin
    with torch.no_grad():
        # TF32 GEMMs in TE (see above): the tolerance is TF32's
        torch.testing.assert_close(cpu_model(ids).logits, te_model(ids.cuda()).logits.cpu(), atol=1e-3, rtol=0)
    torch.manual_seed(1)
    back = LlamaForCausalLM(config, backend="te", fp8_lm_head=fp8_lm_head).eval()
    back.load_state_dict(cpu_model.state_dict(), strict=True)  # and the other way round
    for (k, a), (_, b) in zip(sorted(back.state_dict().items()), sorted(te_model.state_dict().items())):
        if not k.endswith("_extra_state"):
            assert torch.equal(a.cpu(), b.cpu()), k


@pytest.mark.gpu
@needs_te
def test_llmjp3_1_8b_forward_backward_on_te():
    config = model_config("llmjp3-1.8b")
    model = LlamaForCausalLM(config, backend="te", params_dtype=torch.bfloat16).train()
    ids = torch.randint(0, config.vocab_size, (1, 4096), device="cuda")
    loss = model.training_loss(ids[:, :-1], ids[:, 1:]).loss
    loss.backward()
    grad_norm = torch.sqrt(sum(p.grad.float().pow(2).sum() for p in model.parameters())).item()
    print(f"[1.8b te] loss {loss.item():.4f} grad norm {grad_norm:.3f} "
          f"peak mem {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    assert abs(loss.item() - torch.log(torch.tensor(float(config.vocab_size))).item()) < 1.0
    assert torch.isfinite(torch.tensor(grad_norm)) and grad_norm > 0


@pytest.mark.gpu
@needs_te
@pytest.mark.parametrize("qkv_format", ["bshd", "sbhd"])
def test_fused_qkv_rope_matches_the_split_and_two_rotations(qkv_format):
    """TE's one-kernel QKV split + RoPE (``model.fused_qkv_rope``) gives the Q, K, V and the QKV gradient of the
    unfused path (views, then TE's RoPE kernel on Q and on K), and those of the pure-PyTorch formula, with several
    query heads per KV group, in both token layouts."""
    from llmjp_ds.model import te_layers, torch_layers
    from llmjp_ds.model.llama import rope_freqs

    kv, group, d = 4, 3, 128
    torch.manual_seed(0)
    qkv = torch.randn(2, 256, kv, (group + 2) * d, device="cuda", dtype=torch.bfloat16)
    freqs = rope_freqs(torch.arange(256, device="cuda"), d, 10000.0)
    upstream = [torch.randn(2, 256, n, d, device="cuda", dtype=torch.bfloat16) for n in (kv * group, kv, kv)]
    if qkv_format == "sbhd":
        qkv, upstream = qkv.transpose(0, 1).contiguous(), [u.transpose(0, 1).contiguous() for u in upstream]
    results, copies = [], []
    for split in (lambda t: te_layers.split_qkv_rope(t, freqs, group, d, qkv_format, fused=True),
                  lambda t: te_layers.split_qkv_rope(t, freqs, group, d, qkv_format, fused=False),
                  lambda t: torch_layers.split_qkv_rope(t, freqs, group, d, qkv_format)):
        x = qkv.clone().requires_grad_(True)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out = split(x)
            torch.autograd.backward(out, upstream)
            torch.cuda.synchronize()
        # the strided copies of the split and the concatenation of its backward
        copies.append(sum(e.count for e in prof.key_averages() if "copy" in e.key.lower() or "cat" in e.key.lower()))
        results.append(([o.detach() for o in out], x.grad))
    (fused, g_fused), (unfused, g_unfused), (formula, g_formula) = results
    print(f"[fused qkv rope {qkv_format}] copy/cat kernels fused {copies[0]}, unfused {copies[1]}")
    assert copies[0] == 0 < copies[1]
    assert [o.shape for o in fused] == [o.shape for o in formula]
    worst = max((a.float() - b.float()).abs().max().item() for a, b in zip(fused + [g_fused], unfused + [g_unfused]))
    print(f"[fused qkv rope {qkv_format}] max |fused - unfused| {worst:.2e}")
    for a, b in zip(fused + [g_fused], unfused + [g_unfused]):  # both rotate in fp32: at most a rounding apart
        torch.testing.assert_close(a, b, atol=1e-2, rtol=8e-3)
    for a, b in zip(fused + [g_fused], formula + [g_formula]):
        # the formula casts cos/sin to bf16 first, as HF does: one bf16 rounding of |x| <= ~5
        torch.testing.assert_close(a, b, atol=5e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_te
@pytest.mark.parametrize("group,qkv_format", [(1, "bshd"), (3, "bshd"), (1, "sbhd"), (3, "sbhd")])
def test_cudnn_attention_core_matches_te_dot_product_attention(group, qkv_format):
    """``model.attention_core: cudnn`` (torch's SDPA on its cuDNN backend) gives TE's DotProductAttention's output
    and Q, K, V gradients: on the strided Q, K, V views of one QKV buffer (the model's in-place RoPE, one query
    head per KV group) and on separate tensors with several query heads per group, batch- and sequence-first.
    TE's own path still runs a recomputed core."""
    from llmjp_ds.model import te_layers

    kv, d, b, s = 4, 128, 2, 512
    torch.manual_seed(0)
    packed = torch.randn(b, s, kv, (group + 2) * d, device="cuda", dtype=torch.bfloat16)
    if qkv_format == "sbhd":
        packed = packed.transpose(0, 1).contiguous()
    views = tuple(t.contiguous() for t in (packed[..., :group * d].reshape(*packed.shape[:2], kv * group, d),
                                            packed[..., group * d:(group + 1) * d], packed[..., (group + 1) * d:]))
    upstream = torch.randn(*packed.shape[:2], kv * group, d, device="cuda", dtype=torch.bfloat16)
    results = []
    for via_torch, recompute in ((True, False), (False, False), (True, True)):
        core = te_layers.DotProductAttention(kv * group, d, kv, qkv_format=qkv_format, via_torch=via_torch)
        if group == 1:  # the views of one leaf, as the model's RoPE hands them over
            leaf = packed.detach().clone().requires_grad_(True)
            qkv = [leaf[..., :d], leaf[..., d:2 * d], leaf[..., 2 * d:]]
        else:
            qkv = [t.detach().clone().requires_grad_(True) for t in views]
        out = core(*qkv, checkpoint_core_attention=recompute)
        out.reshape(upstream.shape).backward(upstream)
        grads = [leaf.grad] if group == 1 else [t.grad for t in qkv]
        results.append([out.detach().reshape(upstream.shape)] + grads)
    assert core.torch_refused is None
    (cudnn, te_core, recomputed) = results
    worst = max((a.float() - b.float()).abs().max().item() for a, b in zip(cudnn, te_core))
    print(f"[cudnn attention core g={group} {qkv_format}] max |torch cuDNN - TE| {worst:.2e}")
    for a, b in zip(cudnn, te_core):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=1e-2)
    for a, b in zip(recomputed, te_core):  # the recomputed core is TE's
        torch.testing.assert_close(a, b, atol=2e-2, rtol=1e-2)


@pytest.mark.gpu
@needs_te
@pytest.mark.parametrize("fp8", [False, True])
def test_fused_residual_norm_matches_autograds_add(fp8):
    """``model.fused_residual_norm``: each residual's gradient added inside TE's norm backward
    (``rmsnorm_bwd_add``) gives the model's loss and the gradients of the unfused path (autograd's add): in BF16
    within a bf16 rounding per layer; in FP8 delayed scaling (after two calibrating iterations) as close to the
    BF16 gradients as the unfused path's. Two adds per layer fewer run."""
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Format

    from llmjp_ds.model import residual_grad
    from llmjp_ds.model.options import ModelOptions

    config = small_config(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, ffn_hidden_size=512,
                          num_layers=3, seq_len=256, vocab_size=512)
    torch.manual_seed(0)
    reference = LlamaForCausalLM(config, backend="te", params_dtype=torch.bfloat16).train()
    ids = torch.randint(0, config.vocab_size, (2, 257), device="cuda")

    def run(fused: bool, fp8: bool):
        model = LlamaForCausalLM(config, backend="te", params_dtype=torch.bfloat16,
                                 options=ModelOptions(fused_residual_norm=fused)).train()
        model.load_state_dict(reference.state_dict())  # the same weights and a fresh FP8 state for each path
        assert all(layer.fused_residual_norm is fused for layer in model.model.layers)
        for _ in range(2 if fp8 else 0):  # delayed scaling: scales from the amaxes of these iterations
            with te.autocast(enabled=True, recipe=DelayedScaling(fp8_format=Format.HYBRID)):
                loss = model.training_loss(ids[:, :-1], ids[:, 1:]).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            with te.autocast(enabled=fp8, recipe=DelayedScaling(fp8_format=Format.HYBRID)):
                loss = model.training_loss(ids[:, :-1], ids[:, 1:]).loss
            loss.backward()
            torch.cuda.synchronize()
        adds = sum(e.count for e in prof.key_averages() if "CUDAFunctor_add" in e.key)
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, adds

    def distance(grads, to):  # the worst relative distance over the parameters, and where
        return max((((grads[n] - g).float().norm() / g.float().norm()).item(), n) for n, g in to.items())

    (loss_plain, grads_plain, adds_plain), (loss_fused, grads_fused, adds_fused) = (run(f, fp8) for f in (False, True))
    assert not residual_grad.pending()
    apart = distance(grads_fused, grads_plain)
    print(f"[fused residual norm fp8={fp8}] adds {adds_plain} -> {adds_fused}, loss {loss_plain.item():.6f} / "
          f"{loss_fused.item():.6f}, fused vs unfused: worst relative gradient difference {apart[0]:.2e} ({apart[1]})")
    assert torch.equal(loss_fused, loss_plain)  # the forward is the same
    assert adds_plain - adds_fused == 2 * config.num_hidden_layers
    if not fp8:
        assert apart[0] < 2e-2, apart
        return
    _, grads_bf16, _ = run(False, False)
    fused_err, plain_err = distance(grads_fused, grads_bf16), distance(grads_plain, grads_bf16)
    print(f"[fused residual norm fp8] against BF16: fused {fused_err[0]:.2e} ({fused_err[1]}), "
          f"unfused {plain_err[0]:.2e} ({plain_err[1]})")
    assert fused_err[0] <= 1.5 * plain_err[0] + 1e-2, (fused_err, plain_err)
