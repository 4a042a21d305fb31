"""``model/main_grad.py`` without DeepSpeed: the embedding and head accumulate their weight gradient into an
fp32 ``main_grad`` (the protocol ``engine.fuse_grad_accumulation`` switches on), against float64 references,
and are plain ``F.embedding`` / ``F.linear`` otherwise."""

from __future__ import annotations

import pytest
import torch

from llmjp_ds.model.main_grad import HeadLinear, TokenEmbedding, accumulate_wgrad

V, H, MICRO = 40, 16, 3


def _pair(fuse: bool):
    torch.manual_seed(0)
    embed = TokenEmbedding(V, H, dtype=torch.bfloat16)
    head = HeadLinear(H, V, init_std=0.5, dtype=torch.bfloat16)
    if fuse:
        for m in (embed, head):
            m.weight.main_grad = torch.zeros(m.weight.shape)
            m.weight.grad_added_to_main_grad = False
            m.fuse_wgrad_accumulation = True
    return embed, head


def _micro_batches():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V // 2, (MICRO, 2, 9), generator=g)  # repeated tokens; half the vocabulary unseen
    r = (torch.randint(-8, 9, (MICRO, 2, 9, V), generator=g) / 8).to(torch.bfloat16)  # the head's output grad
    return ids, r


def _run(fuse: bool):
    embed, head = _pair(fuse)
    ids, r = _micro_batches()
    record = {"x": [], "gx": [], "ge": [], "grads": []}
    for m in range(MICRO):
        e = embed(ids[m])
        e.register_hook(lambda g: record["ge"].append(g.clone()))
        x = torch.tanh(e.float()).to(torch.bfloat16)
        x.retain_grad()
        y = head(x)
        (y.float() * r[m].float()).sum().backward()
        record["x"].append(x.detach())
        record["gx"].append(x.grad)
        record["grads"].append((embed.weight.grad, head.weight.grad))
        embed.weight.grad = head.weight.grad = None
    return embed, head, ids, r, record


def test_fused_head_and_embedding_sum_in_fp32_into_main_grad():
    embed, head, ids, r, rec = _run(fuse=True)
    want_head = sum(r[m].reshape(-1, V).double().t() @ rec["x"][m].reshape(-1, H).double() for m in range(MICRO))
    want_embed = torch.zeros(V, H, dtype=torch.float64)
    for m in range(MICRO):
        want_embed.index_add_(0, ids[m].reshape(-1), rec["ge"][m].reshape(-1, H).double())
    for got, want in ((head.weight.main_grad, want_head), (embed.weight.main_grad, want_embed)):
        assert got.dtype == torch.float32
        assert want.abs().max() > 0
        assert (got.double() - want).abs().max() <= 1e-6 * want.abs().max()
    assert embed.weight.main_grad[V // 2:].abs().max() == 0  # rows of tokens not in any batch stay untouched
    for w in (embed.weight, head.weight):
        assert w.grad_added_to_main_grad is True
    for ge, gh in rec["grads"]:  # what autograd hands DeepSpeed's hook: a placeholder of the weight's shape
        assert ge.shape == (V, H) and gh.shape == (V, H) and ge.dtype == gh.dtype == torch.bfloat16


def test_input_gradients_are_those_of_the_plain_modules():
    _, _, _, _, fused = _run(fuse=True)
    _, _, _, _, plain = _run(fuse=False)
    for a, b in zip(fused["gx"], plain["gx"]):
        assert torch.equal(a, b)
    for a, b in zip(fused["ge"], plain["ge"]):
        assert torch.equal(a, b)


def test_unfused_modules_are_plain_linear_and_embedding():
    embed, head, ids, r, rec = _run(fuse=False)
    ref_e, ref_h = torch.nn.Embedding(V, H, dtype=torch.bfloat16), torch.nn.Linear(H, V, bias=False,
                                                                                   dtype=torch.bfloat16)
    ref_e.load_state_dict(embed.state_dict())
    ref_h.load_state_dict(head.state_dict())
    assert list(embed.state_dict()) == list(ref_e.state_dict()) == ["weight"]
    m = MICRO - 1
    x = torch.tanh(ref_e(ids[m]).float()).to(torch.bfloat16)
    (ref_h(x).float() * r[m].float()).sum().backward()
    assert torch.equal(rec["grads"][m][0], ref_e.weight.grad)
    assert torch.equal(rec["grads"][m][1], ref_h.weight.grad)
    assert not hasattr(embed.weight, "main_grad")


def test_no_grad_and_frozen_weights_take_the_plain_path():
    embed, head = _pair(fuse=True)
    ids, _ = _micro_batches()
    with torch.no_grad():
        assert torch.equal(head(embed(ids[0])), torch.nn.functional.linear(embed.weight[ids[0]], head.weight))
    head.weight.requires_grad_(False)
    x = embed(ids[0])
    head(x).float().sum().backward()
    assert head.weight.main_grad.abs().max() == 0 and head.weight.grad is None
    assert embed.weight.main_grad.abs().max() > 0


def test_head_initialises_from_its_std():
    torch.manual_seed(0)
    w = HeadLinear(64, 1000, init_std=0.02).weight
    assert w.shape == (1000, 64) and abs(w.mean().item()) < 1e-3 and abs(w.std().item() - 0.02) < 1e-3


def test_accumulate_wgrad_adds_to_what_is_there():
    g = torch.Generator().manual_seed(3)
    out = torch.randn(5, 4, generator=g)
    start = out.clone()
    a = torch.randn(7, 5, generator=g).to(torch.bfloat16)
    b = torch.randn(7, 4, generator=g).to(torch.bfloat16)
    accumulate_wgrad(out, a, b)
    assert torch.allclose(out.double(), start.double() + a.double().t() @ b.double(), atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_accumulation_is_one_fp32_gemm():
    g = torch.Generator(device="cuda").manual_seed(0)
    out = torch.randn(256, 128, device="cuda", generator=g)
    start = out.clone()
    a = torch.randn(512, 256, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(512, 128, device="cuda", generator=g).to(torch.bfloat16)
    accumulate_wgrad(out, a, b)
    want = start.double() + a.double().t() @ b.double()
    assert (out.double() - want).abs().max() <= 1e-4 * want.abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fused_backward_never_waits_for_the_gpu():
    """The embedding's row scatter and the head's GEMM are queued without a host synchronisation: either would
    stall the host at every micro-batch's backward (CUDA's sync debug mode turns a synchronising call into an
    error, raised through backward)."""
    embed = TokenEmbedding(1000, 64, device="cuda", dtype=torch.bfloat16)
    head = HeadLinear(64, 1000, init_std=0.02, device="cuda", dtype=torch.bfloat16)
    for m in (embed, head):
        m.weight.main_grad = torch.zeros(m.weight.shape, device="cuda")
        m.weight.grad_added_to_main_grad = False
        m.fuse_wgrad_accumulation = True
    ids = torch.randint(0, 1000, (2, 128), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        head(embed(ids)).float().square().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert embed.weight.main_grad.abs().sum() > 0 and head.weight.main_grad.abs().sum() > 0
    assert embed.weight.grad_added_to_main_grad and head.weight.grad_added_to_main_grad
