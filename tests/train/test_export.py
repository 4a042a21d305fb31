"""``llmjp-ds export --dtype fp32`` from the checkpoint of every layout (1 process, ZeRO-1/2/3, pipeline=2).

The export's own check (transformers reloads it; its logits must equal our model's) has to pass, the directory
must be a plain ``model_type: llama`` checkpoint that ``AutoModelForCausalLM`` and ``AutoTokenizer`` load without
custom code, and -- the independent references --

* the exports of the 2-process layouts compute the 1-process export's logits on a probe batch within
  ``LOGITS_RTOL = 1e-3`` of the largest logit: the same trained weights up to fp32 summation order (see
  test_equivalence). Adam turns that order into visible weight differences where a gradient is near zero
  (m / sqrt(v) is about +-1 whatever its size, so a flipped sign moves the weight by 2 x lr): measured max on the
  ja/en/code blend ZeRO-3 4.5e-4, on the single-corpus blend ZeRO-1 1.1e-6, ZeRO-2 8.2e-7, ZeRO-3 1.9e-6, PP2
  2.4e-7. A mapping error moves logits by O(1). And
* transformers' own Llama, loaded from the export of the step-N checkpoint, computes the loss the trainer logged
  for step N+1 on the trainer's step-(N+1) samples within ``LOGGED_LOSS_RTOL = 1e-5`` (measured: equal).

And the error paths: a missing tag, or an existing output without ``--force``, exit non-zero with one line
(no traceback) and leave the existing output untouched.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from tests.runs import COMMON_SETS, N, STEPS, cli, max_rel_diff, read_json, trail

pytestmark = pytest.mark.slow

LAYOUTS = ["single", "zero1", "zero2", "zero3", "pp2"]
LOGITS_RTOL = 1e-3
LOGGED_LOSS_RTOL = 1e-5


@functools.lru_cache(maxsize=None)
def _load(export_dir: str):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()


def _probe_logits(export_dir) -> torch.Tensor:
    probe = torch.randint(0, 8000, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return _load(str(export_dir))(probe).logits.float()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_is_a_plain_llama(layout, exports):
    from transformers import AutoTokenizer

    out, stdout = exports(layout)
    assert f"step {STEPS}" in stdout and "AutoModelForCausalLM reload check passed" in stdout, stdout
    config = read_json(out / "config.json")
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert "auto_map" not in config
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (64, 2, 8064)
    model = _load(str(out))
    assert type(model).__module__.startswith("transformers.models.llama"), type(model)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    text = "日本の首都は東京です。 The history of"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id == config["bos_token_id"]
    assert max(ids) < 8000 and len(ids) > 4
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", [x for x in LAYOUTS if x != "single"])
def test_exported_logits_match_single_process(layout, exports):
    ref = _probe_logits(exports("single")[0])
    got = _probe_logits(exports(layout)[0])
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    print(f"\n{layout}: exported logits vs 1-process export: max |d| / max |logit| = {rel:.2e}")
    assert rel <= LOGITS_RTOL, f"{layout}: exported logits differ from the 1-process export by {rel:.2e}"


@pytest.mark.timeout(900)
def test_export_reproduces_logged_loss(runs, tmp_path):
    """Export the step-N checkpoint (``--tag``) of the resumed 1-process run and let transformers compute the
    loss of step N+1's samples: it must be the loss the trainer logged for step N+1."""
    from llmjp_ds.config import load_config, model_config_of
    from llmjp_ds.trainer import data_plan

    run_dir = runs.resumed("single")
    out = tmp_path / "hf"
    result = cli(["export", "--run", str(run_dir), "--tag", f"step{N:08d}", "--output", str(out), "--dtype", "fp32"],
                 tmp_path / "export")
    assert f"step{N:08d} (step {N})" in result.stdout, result.stdout

    cfg = load_config(None, [f"run_dir={tmp_path / 'scratch'}", *COMMON_SETS, f"train.steps={STEPS}"])
    plan = data_plan(cfg, model_config_of(cfg))
    train_ds, _ = plan.build(cfg.data.seq_len, STEPS * cfg.train.global_batch_size, cfg.train.global_batch_size)
    gbs = cfg.train.global_batch_size
    # step N+1 (counting from 1) consumes the global samples [N * gbs, (N + 1) * gbs)
    samples = range(N * gbs, (N + 1) * gbs)
    tokens = torch.from_numpy(np.stack([np.asarray(train_ds[i], dtype=np.int64) for i in samples]))
    assert tokens.shape == (gbs, cfg.data.seq_len + 1)
    with torch.no_grad():
        logits = _load(str(out))(tokens[:, :-1]).logits.float()
    hf_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).item()
    logged = trail(run_dir)[N]  # the record of step N+1
    assert logged["step"] == N + 1
    rel = max_rel_diff([hf_loss], [logged["loss"]])
    print(f"\ntransformers loss {hf_loss:.6f} vs logged {logged['loss']:.6f}: rel {rel:.2e}")
    assert rel <= LOGGED_LOSS_RTOL


def _snapshot(path) -> dict:
    return {p.relative_to(path).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(path.rglob("*")) if p.is_file()}


def _one_line_error(result) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert not result.stdout.strip(), result.stdout
    return lines[0]


@pytest.mark.timeout(900)
def test_export_errors_leave_output_untouched(runs, tmp_path):
    run_dir = runs.full("single")
    out = tmp_path / "existing"
    out.mkdir()
    (out / "config.json").write_text('{"keep": "me"}')
    (out / "notes.txt").write_text("a colleague's export")
    before = _snapshot(out)

    missing = cli(["export", "--run", str(run_dir), "--tag", "step00000099", "--output", str(out), "--dtype", "fp32",
                   "--force"], tmp_path / "missing-tag", check=False)
    line = _one_line_error(missing)
    assert "step00000099" in line and f"step{STEPS:08d}" in line  # names the tag and what is available
    assert _snapshot(out) == before

    exists = cli(["export", "--run", str(run_dir), "--output", str(out), "--dtype", "fp32"], tmp_path / "exists",
                 check=False)
    line = _one_line_error(exists)
    assert str(out) in line and "--force" in line
    assert _snapshot(out) == before
