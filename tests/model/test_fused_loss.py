"""``CausalLMLoss(fused=True)``: the compiled formula against the eager one on bf16 logits, and the fallback to
eager when no compiler works (kept per loss object)."""

from __future__ import annotations

import shutil

import pytest
import torch

from llmjp_ds.model.loss import IGNORE_INDEX, CausalLMLoss

VOCAB = 1000


def make_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(2, 64, VOCAB, generator=g) * 4).to(torch.bfloat16)
    targets = torch.randint(0, VOCAB, (2, 64), generator=g)
    targets[0, :9] = IGNORE_INDEX  # a masked prompt
    targets[1, -5:] = IGNORE_INDEX  # padding
    targets[1, 20] = IGNORE_INDEX
    return logits, targets


def reference(logits, targets, z_coeff):
    """An independent fp64 computation of (loss, lm_loss, z_loss)."""
    x = logits.double().reshape(-1, VOCAB)
    t = targets.reshape(-1)
    keep = t != IGNORE_INDEX
    lse = torch.logsumexp(x[keep], dim=-1)
    lm = (lse - x[keep].gather(1, t[keep].unsqueeze(1)).squeeze(1)).mean()
    z = z_coeff * lse.pow(2).mean()
    return lm + z, lm, z


def run(logits, targets, z_coeff, fused, loss_fn=None):
    leaf = logits.clone().requires_grad_(True)
    parts = (loss_fn or CausalLMLoss(z_coeff, fused=fused))(leaf, targets)
    parts.loss.backward()
    return parts, leaf.grad


needs_compiler = pytest.mark.skipif(shutil.which("g++") is None,
                                    reason="torch.compile on CPU needs a C++ compiler (g++ not on PATH)")


@needs_compiler
@pytest.mark.timeout(300)
@pytest.mark.parametrize("z_coeff", [1e-4, 0.0])
def test_fused_matches_eager(z_coeff, capsys):
    logits, targets = make_inputs()
    loss_fn = CausalLMLoss(z_coeff, fused=True)
    fused, fused_grad = run(logits, targets, z_coeff, True, loss_fn)
    assert "fused loss unavailable" not in capsys.readouterr().err
    assert loss_fn.compiled not in (None, False)  # the compiled path really ran
    eager, eager_grad = run(logits, targets, z_coeff, fused=False)
    for name in ("loss", "lm_loss", "z_loss"):
        f, e = getattr(fused, name), getattr(eager, name)
        assert f.dtype == e.dtype == torch.float32 and f.shape == e.shape == ()
        assert (f - e).abs().item() <= 1e-5, (name, f.item(), e.item())
    # both against fp64 (the eager path is not the only judge)
    ref = reference(logits, targets, z_coeff)
    for name, r in zip(("loss", "lm_loss", "z_loss"), ref):
        assert abs(getattr(fused, name).item() - r.item()) <= 1e-4 * max(1.0, abs(r.item())), name
    if z_coeff:
        assert fused.z_loss.item() > 0
    else:
        assert fused.z_loss.item() == 0.0
    assert fused.loss.item() == pytest.approx(fused.lm_loss.item() + fused.z_loss.item(), rel=1e-6)
    assert fused_grad.dtype == eager_grad.dtype == torch.bfloat16
    scale = eager_grad.float().abs().max()
    assert (fused_grad.float() - eager_grad.float()).abs().max() <= 1e-3 * scale
    # ignored positions get no gradient at all
    ignored = targets == IGNORE_INDEX
    assert fused_grad[ignored].abs().max().item() == 0.0
    assert fused_grad[~ignored].abs().amax(-1).min().item() > 0


def test_fallback_to_eager_when_the_compiler_fails(monkeypatch, capsys):
    calls = []

    def broken(*args, **kwargs):
        calls.append(args)
        raise RuntimeError("no compiler\nsecond line of the compiler's complaint")

    loss_fn = CausalLMLoss(1e-4, fused=True)
    loss_fn.compiled = broken
    logits, targets = make_inputs(1)
    got, got_grad = run(logits, targets, 1e-4, True, loss_fn)
    err = capsys.readouterr().err
    assert len(calls) == 1
    assert loss_fn.compiled is False
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "fused loss unavailable" in lines[0]
    assert "RuntimeError: no compiler" in lines[0] and "second line" not in err
    want, want_grad = run(logits, targets, 1e-4, fused=False)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.equal(got_grad, want_grad)
    # later calls go straight to eager: no second attempt, no second message
    again, _ = run(logits, targets, 1e-4, True, loss_fn)
    assert len(calls) == 1 and capsys.readouterr().err == ""
    assert torch.equal(again.loss, want.loss)


@pytest.mark.parametrize("error", [torch.cuda.OutOfMemoryError, KeyboardInterrupt])
def test_out_of_memory_and_interrupts_are_not_taken_for_a_missing_compiler(monkeypatch, capsys, error):
    """An OOM inside the compiled loss is the caller's problem (and the eager path would need more memory)."""
    def failing(*args, **kwargs):
        raise error("out of memory")

    loss_fn = CausalLMLoss(0.0, fused=True)
    loss_fn.compiled = failing
    logits, targets = make_inputs(2)
    with pytest.raises(error):
        loss_fn(logits, targets)
    assert loss_fn.compiled is failing  # not marked unavailable
    assert "fused loss unavailable" not in capsys.readouterr().err
