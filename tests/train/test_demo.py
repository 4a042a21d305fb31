"""``llmjp-ds demo`` end to end, shortened to 60 steps (the full demo is 200) to keep CI short.

It runs as a user runs it: one process, no launcher and no MASTER_PORT in the environment, wandb offline.
References:

* the logged loss falls clearly: measured 9.03 -> 4.33 (step 1 -> 60) and 8.73 -> 5.10 (mean of the first ten
  steps -> mean of the last ten); the test asks for a drop of 2.0 in both;
* validation loss (every 30 steps, the held-out documents) falls: measured 8.02 -> 7.42; asked: 0.2;
* transformers' ``AutoModelForCausalLM`` + ``AutoTokenizer`` loaded from the export alone score a bundled
  training document at least 2.0 below the step-1 loss (measured 5.06 vs 9.03: the export is the trained model,
  not the initial one);
* it prints one continuation per prompt, each extending its prompt.

``llmjp-ds demo --moe`` (the ``tiny-moe`` shape, the same 60 steps), against the same asks: measured 9.04 -> 5.95
(step 1 -> 60), 8.77 -> 6.13 (the means of ten), validation 6.35 -> 5.97, and the export (``qwen3_moe``, loaded by
``AutoModelForCausalLM`` as transformers' ``Qwen3MoeForCausalLM``) scoring the training document at 5.86; besides,
every step's record carries the routing, the last one the whole load matrix (each of the 4 layers' loads summing
to the step's 8 x 128 tokens x 2 experts a token), and the step line its load-balancing loss.
"""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from tests.launch import subprocess_env
from tests.runs import cli, read_json, trail

pytestmark = pytest.mark.slow

STEPS = 60


def run_demo(tmp_path, *args: str):
    """``llmjp-ds demo ARGS`` of :data:`STEPS` steps (validation and saves every 30) in ``<tmp_path>/demo``: the
    CLI's result, the output directory and the step records, checked for what every demo's are."""
    out = tmp_path / "demo"
    result = cli(["demo", *args, "--output", str(out), "--set", f"train.steps={STEPS}", "--set",
                  "train.eval_interval=30", "--set", "checkpoint.interval=30"], tmp_path / "demo", env=subprocess_env(),
                 timeout=900)
    print(f"\ndemo {' '.join(args)} wall time {result.wall_s:.0f} s")
    from llmjp_ds.checkpoint import checkpoint_dir, latest_tag
    from llmjp_ds.metrics.record import read_metrics

    run = out / "run"
    steps = trail(run)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    loss = [r["loss"] for r in steps]
    assert loss[-1] < loss[0] - 2.0, loss
    assert sum(loss[-10:]) / 10 < sum(loss[:10]) / 10 - 2.0, loss
    valid = {r["step"]: r["valid_loss"] for r in read_metrics(run) if "valid_loss" in r}
    assert sorted(valid) == [30, 60], valid
    assert valid[60] < valid[30] - 0.2, valid
    assert latest_tag(run) == f"step{STEPS:08d}"
    assert (checkpoint_dir(run) / "step00000030" / "llmjp_ds.json").is_file()
    return result, out, steps


def assert_export_learned_and_generates(hf, step1_loss: float, stdout: str):
    """The export alone (``AutoModelForCausalLM`` + ``AutoTokenizer``) scores a bundled training document at least
    2.0 below the step-1 loss, and the demo printed one continuation per prompt, each extending it; the model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from llmjp_ds.data import bundled_corpus_files
    from llmjp_ds.demo import PROMPTS

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(str(hf))
    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    with gzip.open(bundled_corpus_files()[0], "rt", encoding="utf-8") as f:
        document = json.loads(f.readline())["text"]  # the corpus's first document: in the train split
    ids = tokenizer(document, return_tensors="pt")["input_ids"][:, :128]
    with torch.no_grad():
        doc_loss = model(input_ids=ids, labels=ids).loss.item()
    print(f"step-1 loss {step1_loss:.3f}; exported model on a training document {doc_loss:.3f}")
    assert doc_loss < step1_loss - 2.0

    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "generating with AutoModelForCausalLM + AutoTokenizer" in line)
    samples = lines[start + 1:start + 1 + len(PROMPTS)]
    assert len(samples) == len(PROMPTS), stdout[-2000:]
    for prompt, sample in zip(PROMPTS, samples):
        text = sample.strip()
        assert text.startswith(prompt) and len(text) > len(prompt) + 2, (prompt, sample)
    return model


@pytest.mark.timeout(1200)
def test_demo_end_to_end(train_env, tmp_path):
    result, out, steps = run_demo(tmp_path)
    config = read_json(out / "hf" / "config.json")
    assert config["model_type"] == "llama" and "auto_map" not in config
    assert not [key for r in steps for key in r if key.startswith("moe_")]  # a dense run records no routing
    assert " aux " not in result.stdout
    assert_export_learned_and_generates(out / "hf", steps[0]["loss"], result.stdout)


@pytest.mark.timeout(1200)
def test_moe_demo_end_to_end(train_env, tmp_path):
    result, out, steps = run_demo(tmp_path, "--moe")
    assert result.stdout.startswith(f"[demo] training the tiny-moe model ({STEPS} steps)"), result.stdout[:300]
    config = read_json(out / "hf" / "config.json")
    assert (config["model_type"], config["architectures"], config["num_local_experts"],
            config["num_experts_per_tok"], config["num_hidden_layers"]) == (
        "qwen3_moe", ["Qwen3MoeForCausalLM"], 8, 2, 4) and "auto_map" not in config
    assert config["router_aux_loss_coef"] == 0.01  # the run's (model.moe_aux_loss_coeff), not transformers' 0.001
    for record in steps:
        assert len(record["moe_layer_imbalance"]) == 4 and record["moe_dropped_tokens"] == 0
        assert f"step {record['step']:>2}/{STEPS} | loss {record['loss']:.4f} z {record['z_loss']:.2e} aux " \
               f"{record['moe_aux_loss']:.3f} | " in result.stdout
    assert [r["step"] for r in steps if "moe_expert_load" in r] == [STEPS]  # the last step (interval 100)
    assert [sum(layer) for layer in steps[-1]["moe_expert_load"]] == [8 * 128 * 2] * 4
    model = assert_export_learned_and_generates(out / "hf", steps[0]["loss"], result.stdout)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
