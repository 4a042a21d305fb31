"""The streaming cross-entropy + z-loss kernels (:mod:`llmjp_ds.model.kernels.cross_entropy`, the fused loss on
CUDA) against the eager fp32 formula and the compiled loss: the loss parts and the gradient over the logits,
with ignored targets; and the model returning no logits when this loss overwrites them. On a CPU with Triton
installed the kernels run under Triton's interpreter."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from llmjp_ds.model.loss import IGNORE_INDEX, CausalLMLoss, causal_lm_loss
from tests.model.test_kernel_rope import interpreted

needs_te = pytest.mark.skipif(
    not torch.cuda.is_available() or not __import__("llmjp_ds.model.backend", fromlist=["x"]).te_importable(),
    reason="needs CUDA and Transformer Engine (run on the H200)")


def _inputs(rows, vocab, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = (torch.randn(2, rows, vocab, generator=g) * 3).to(device=device, dtype=torch.bfloat16)
    targets = torch.randint(0, vocab, (2, rows), generator=g)
    targets[0, :3] = IGNORE_INDEX
    return logits, targets.to(device)


def _parts_and_grad(fn, logits, targets):
    x = logits.clone().requires_grad_(True)
    y = x * 1  # a non-leaf, as the head's output is (the kernel's backward writes into it)
    parts = fn(y, targets)
    parts.loss.backward()
    return [p.detach().float() for p in parts], x.grad.float()


def _compare(got, want, what, grad_atol=None):
    (parts, grad), (ref_parts, ref_grad) = got, want
    print(f"[fused ce] {what}: loss {parts[0].item():.6f} vs {ref_parts[0].item():.6f}, z {parts[2].item():.3e} "
          f"vs {ref_parts[2].item():.3e}, max |grad diff| {(grad - ref_grad).abs().max().item():.2e}")
    for a, b in zip(parts, ref_parts):  # fp32 sums in another order
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6)
    # one bf16 rounding of each gradient entry (|g| <= 1 / count)
    scale = ref_grad.abs().max().item()
    torch.testing.assert_close(grad, ref_grad, rtol=8e-3, atol=grad_atol or scale * 8e-3)


def check_kernels_under_the_interpreter():
    from llmjp_ds.model.kernels.cross_entropy import cross_entropy_z_loss
    from llmjp_ds.model.loss import LossParts

    logits, targets = _inputs(8, 5000, "cpu")  # two blocks per row, the second one partial
    for coeff in (0.0, 1e-4):
        got = _parts_and_grad(lambda x, t: LossParts(*cross_entropy_z_loss(x, t, coeff, IGNORE_INDEX)), logits, targets)
        _compare(got, _parts_and_grad(lambda x, t: causal_lm_loss(x, t, coeff), logits, targets),
                 f"interpreter z={coeff}")


@pytest.mark.skipif(torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="the interpreter check is for CPU machines with Triton installed")
def test_kernels_match_the_formula_under_the_interpreter():
    interpreted("check_kernels_under_the_interpreter", __name__)


@pytest.mark.gpu
@needs_te
@pytest.mark.parametrize("coeff", [0.0, 1e-4])
def test_kernels_match_the_formula_and_the_compiled_loss(monkeypatch, coeff):
    logits, targets = _inputs(512, 99584, "cuda")
    monkeypatch.setenv("LLMJP_DS_FUSED_LOSS", "triton")
    loss = CausalLMLoss(coeff, fused=True)
    assert loss.overwrites(logits)
    got = _parts_and_grad(loss, logits, targets)
    _compare(got, _parts_and_grad(lambda x, t: causal_lm_loss(x, t, coeff), logits, targets), f"vs eager z={coeff}")
    monkeypatch.setenv("LLMJP_DS_FUSED_LOSS", "compiled")
    compiled = CausalLMLoss(coeff, fused=True)
    assert not compiled.overwrites(logits)
    _compare(got, _parts_and_grad(compiled, logits, targets), f"vs compiled z={coeff}")


@pytest.mark.gpu
@needs_te
def test_model_trains_through_the_kernels_and_returns_no_logits(monkeypatch):
    """The same small TE model and batch through the Triton loss and the compiled loss: equal loss parts and
    weight gradients; the Triton path returns no logits (their memory held the gradient)."""
    from llmjp_ds.model import LlamaForCausalLM, model_config

    config = model_config("tiny", hidden_size=256, num_layers=2, num_attention_heads=4, num_key_value_heads=4,
                          ffn_hidden_size=512, vocab_size=32000, seq_len=256)
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (2, 257), device="cuda")
    results = []
    for kernel in ("triton", "compiled"):
        monkeypatch.setenv("LLMJP_DS_FUSED_LOSS", kernel)
        torch.manual_seed(0)
        model = LlamaForCausalLM(config, backend="te", params_dtype=torch.bfloat16, z_loss_coeff=1e-4,
                                 fused_loss=True).train()
        out = model(input_ids=ids[:, :-1], shift_labels=ids[:, 1:])
        assert (out.logits is None) == (kernel == "triton")
        out.loss.backward()
        results.append(([out.loss.item(), out.lm_loss.item(), out.z_loss.item()],
                        [p.grad.float() for p in model.parameters()]))
    (parts, grads), (ref_parts, ref_grads) = results
    print(f"[fused ce] model: triton {parts} vs compiled {ref_parts}")
    torch.testing.assert_close(torch.tensor(parts), torch.tensor(ref_parts), rtol=1e-4, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        assert ((g - r).norm() / r.norm()).item() < 1e-2
