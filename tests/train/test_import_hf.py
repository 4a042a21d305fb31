"""``llmjp-ds import-hf`` starts training from an HF Llama checkpoint: the first logged loss (computed before
any update) is transformers' own loss of the same samples, with and without pipeline parallelism, and split
over a tensor-parallel group of 2 (each rank loads its shard of every weight)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
import transformers

from tests.launch import free_port, run_command, subprocess_env
from tests.runs import COMMON_SETS, cli, trail

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.mark.parametrize("pipeline,tensor", [(1, 1), (2, 1), (1, 2)], ids=["single", "pp2", "tp2"])
def test_first_loss_after_import_is_transformers_loss(train_env, tmp_path, pipeline, tensor):
    from llmjp_ds.config import load_config, model_config_of
    from llmjp_ds.trainer import data_plan
    from llmjp_ds.model.shapes import model_config

    config = model_config("tiny", hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          ffn_hidden_size=128, seq_len=64)
    torch.manual_seed(123)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    run = tmp_path / "run"
    cli(["import-hf", "--model", str(tmp_path / "hf"), "--run", str(run), "--preset", "demo"], tmp_path / "import")
    sets = [*COMMON_SETS, "train.steps=1", f"parallel.pipeline_stages={pipeline}",
            f"parallel.tensor_parallel={tensor}"]
    if pipeline * tensor == 1:
        cmd, env = [sys.executable, "-m", "llmjp_ds.train"], subprocess_env(MASTER_PORT=str(free_port()))
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               f"--master_port={free_port()}", "-m", "llmjp_ds.train"]
        env = subprocess_env()
    cmd += ["--config", str(run / "config.yaml")]
    for value in sets:
        cmd += ["--set", value]
    run_command(cmd, tmp_path / "train", env=env)

    cfg = load_config(run / "config.yaml", [*COMMON_SETS, f"run_dir={tmp_path / 'scratch'}"])
    plan = data_plan(cfg, model_config_of(cfg))
    train_ds, _ = plan.build(cfg.data.seq_len, cfg.train.global_batch_size, cfg.train.global_batch_size)
    tokens = torch.from_numpy(np.stack([np.asarray(train_ds[i], dtype=np.int64)
                                        for i in range(cfg.train.global_batch_size)]))
    with torch.no_grad():
        logits = hf(tokens[:, :-1]).logits.float()
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    logged = trail(run)[0]
    assert logged["step"] == 1
    assert abs(logged["loss"] - expected.item()) <= 1e-5 * expected.item(), (logged["loss"], expected.item())
