"""The DeepSpeed JSON files in ds_configs/ and the hostfiles, checked with DeepSpeed's own parsers.

Contract with the trainer: every file holds the string "auto" at exactly the paths in ``AUTO_PATHS`` and nowhere
else; the trainer replaces them from the run config before DeepSpeed sees the dict. DeepSpeed must never see an
unfilled "auto": its pydantic sub-configs silently drop "auto" and fall back to the default (``bf16.enabled``
becomes False), and a top-level "auto" either crashes (``train_batch_size``) or is kept as a string
(``gradient_clipping``). ``test_deepspeed_does_not_understand_auto`` pins that behaviour.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tests.launch import free_port

REPO = Path(__file__).resolve().parents[2]
DS_CONFIGS = REPO / "ds_configs"
HOSTFILES = REPO / "hostfiles"

AUTO_PATHS = {
    ("train_batch_size",),
    ("train_micro_batch_size_per_gpu",),
    ("gradient_accumulation_steps",),
    ("gradient_clipping",),
    ("bf16", "enabled"),
}
# file -> (zero stage, grad_accum_dtype)
EXPECTED = {
    "zero0": (0, None),
    "zero1": (1, "fp32"),
    "zero2": (2, None),
    "zero3": (3, None),
    "pipeline": (1, "fp32"),
}
BUCKET = 500_000_000


def load(name: str) -> dict:
    return json.loads((DS_CONFIGS / f"{name}.json").read_text())


def auto_paths(tree, prefix=()) -> set[tuple[str, ...]]:
    if isinstance(tree, dict):
        return set().union(*(auto_paths(v, prefix + (k,)) for k, v in tree.items())) if tree else set()
    return {prefix} if tree == "auto" else set()


def fill(cfg: dict, *, micro: int, gas: int, dp: int, clip: float, bf16: bool) -> dict:
    """What the trainer does: replace every "auto" with a value from the run config."""
    cfg = copy.deepcopy(cfg)
    cfg["train_batch_size"] = micro * gas * dp
    cfg["train_micro_batch_size_per_gpu"] = micro
    cfg["gradient_accumulation_steps"] = gas
    cfg["gradient_clipping"] = clip
    cfg["bf16"]["enabled"] = bf16
    assert not auto_paths(cfg)
    return cfg


class FakeMPU:
    """Just enough of an mpu for DeepSpeedConfig to take the data-parallel size from it."""

    def __init__(self, dp: int):
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


@pytest.fixture
def ds_config(monkeypatch):
    """DeepSpeedConfig without a process group: world size 1, or `dp` through a fake mpu.

    DeepSpeedConfig asks deepspeed.comm for the rank first and falls back to world size 1 when no group exists,
    ignoring the mpu; patching get_rank lets the mpu's data-parallel size through.
    """
    import deepspeed.runtime.config as ds_cfg

    def make(cfg: dict, dp: int | None = None):
        if dp is None:
            return ds_cfg.DeepSpeedConfig(cfg)
        monkeypatch.setattr(ds_cfg.dist, "get_rank", lambda *a, **k: 0)
        return ds_cfg.DeepSpeedConfig(cfg, mpu=FakeMPU(dp))

    return make


# --- the JSON files ------------------------------------------------------------------------------------------

def test_every_config_is_present():
    assert sorted(p.stem for p in DS_CONFIGS.glob("*.json")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_auto_exactly_where_the_trainer_fills(name):
    cfg = load(name)
    assert auto_paths(cfg) == AUTO_PATHS
    # values that must be real: DeepSpeed keys only, no optimizer/scheduler (the trainer passes its own)
    assert "optimizer" not in cfg and "scheduler" not in cfg and "fp16" not in cfg
    assert cfg["steps_per_print"] >= 10**6 and cfg["wall_clock_breakdown"] is False
    assert cfg["timers"] == {"throughput": {"enabled": False}}  # no GPU synchronisation per micro-batch
    assert not any(k.startswith("_") for k in cfg), "no comment keys: keep the files plain DeepSpeed JSON"


@pytest.mark.parametrize("bf16", [True, False])
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_deepspeed_parses_filled_config(name, bf16, ds_config):
    stage, accum = EXPECTED[name]
    c = ds_config(fill(load(name), micro=2, gas=3, dp=1, clip=1.0, bf16=bf16))
    assert c.train_batch_size == 6
    assert c.train_micro_batch_size_per_gpu == 2
    assert c.gradient_accumulation_steps == 3
    assert c.gradient_clipping == 1.0
    assert c.bfloat16_config.enabled is bf16
    assert c.zero_optimization_stage == stage
    assert c.zero_enabled == (stage > 0)
    assert c.grad_accum_dtype == accum
    assert c.steps_per_print == 1_000_000_000 and c.wall_clock_breakdown is False
    assert c.timers_config.enabled is False
    assert c.optimizer_name is None and c.scheduler_name is None
    if stage:
        assert c.zero_config.reduce_bucket_size == BUCKET
    if stage in (1, 2):
        assert c.zero_config.allgather_bucket_size == BUCKET
    if name in ("zero2", "zero3"):
        assert c.zero_config.overlap_comm is True and c.zero_config.contiguous_gradients is True
    if name in ("zero1", "pipeline"):
        # fp32 accumulation in a post-accumulate-grad hook; the bf16 .grad is freed right away; the summed
        # gradient stays fp32 through DeepSpeed's all-reduce (else it is rounded to bf16 there, even on one rank)
        assert c.bfloat16_config.immediate_grad_update is True
        import torch

        assert c.communication_data_type == torch.float32
    if stage == 3:
        z = c.zero_config
        assert z.prefetch_bucket_size == 50_000_000
        assert z.param_persistence_threshold == 100_000
        assert z.max_live_parameters == 1_000_000_000
        assert z.max_reuse_distance == 1_000_000_000
        assert z.gather_16bit_weights_on_model_save is False


def test_172b_batch_arithmetic_as_deepspeed_checks_it(ds_config):
    """docs/172b-layout.md's layout without tensor parallelism: PP32 x DP16 on 512 GPUs, micro 1, GBS 1728 -> GAS
    108 (with TP4 x PP16, DP8 -> GAS 216)."""
    c = ds_config(fill(load("pipeline"), micro=1, gas=108, dp=16, clip=1.0, bf16=True), dp=16)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (1728, 1, 108)
    bad = fill(load("pipeline"), micro=1, gas=54, dp=16, clip=1.0, bf16=True)  # 864 = 1 x 54 x 16 ...
    bad["train_batch_size"] = 1728  # ... but claims 1728
    with pytest.raises(AssertionError, match="Check batch related parameters"):
        ds_config(bad, dp=16)


def test_deepspeed_does_not_understand_auto(ds_config):
    base = fill(load("pipeline"), micro=1, gas=2, dp=1, clip=1.0, bf16=True)
    silently_off = copy.deepcopy(base)
    silently_off["bf16"]["enabled"] = "auto"
    assert ds_config(silently_off).bfloat16_config.enabled is False
    kept_as_string = copy.deepcopy(base)
    kept_as_string["gradient_clipping"] = "auto"
    assert ds_config(kept_as_string).gradient_clipping == "auto"
    crashes = copy.deepcopy(base)
    crashes["train_batch_size"] = "auto"
    with pytest.raises(TypeError):
        ds_config(crashes)


def test_deepspeed_key_strictness(ds_config):
    """Unknown keys: tolerated at the top level, rejected inside sub-configs (pydantic extra="forbid")."""
    from pydantic import ValidationError

    base = fill(load("zero1"), micro=1, gas=1, dp=1, clip=1.0, bf16=True)
    assert ds_config({**base, "_comment": "tolerated"}).zero_optimization_stage == 1
    typo = copy.deepcopy(base)
    typo["zero_optimization"]["reduce_bucket_sise"] = 1
    with pytest.raises(ValidationError, match="reduce_bucket_sise"):
        ds_config(typo)


_ENGINE_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch, deepspeed
    torch.set_num_threads(1)
    out = {}
    for name in sys.argv[1:]:
        for bf16 in (True, False):
            cfg = json.load(open(f"ds_configs/{name}.json"))
            cfg.update(train_batch_size=4, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2,
                       gradient_clipping=1.0, bf16={"enabled": bf16})
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
            losses = []
            for _ in range(4):
                x = torch.randn(2, 8, dtype=torch.bfloat16 if bf16 else torch.float32)
                loss = ((engine(x) - x.sum(1, keepdim=True)) ** 2).float().mean()
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            out[f"{name}/{bf16}"] = [type(engine.optimizer).__name__, losses]
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def engine_results():
    """One subprocess (its own process group, so this suite's process stays clean) runs every config."""
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _ENGINE_SCRIPT, *sorted(EXPECTED)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=400)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


# deepspeed 0.19.8's choice of optimizer wrapper (engine._do_optimizer_sanity_check) for a client torch AdamW
OPTIMIZER_WRAPPER = {
    ("zero0", True): "FP16_UnfusedOptimizer",  # DDP_BFLOAT16: fp32 master weights, bf16 grads
    ("zero0", False): "AdamW",
    ("zero1", True): "BF16_Optimizer",  # bf16 + ZeRO-1 + grad_accum_dtype fp32
    ("zero1", False): "DeepSpeedZeroOptimizer",
    ("zero2", True): "DeepSpeedZeroOptimizer", ("zero2", False): "DeepSpeedZeroOptimizer",
    ("zero3", True): "DeepSpeedZeroOptimizer_Stage3", ("zero3", False): "DeepSpeedZeroOptimizer_Stage3",
    ("pipeline", True): "BF16_Optimizer",  # bf16 + ZeRO-1 + grad_accum_dtype fp32
    ("pipeline", False): "DeepSpeedZeroOptimizer",
}


@pytest.mark.timeout(450)
@pytest.mark.parametrize("name,bf16", sorted(OPTIMIZER_WRAPPER))
def test_engine_trains_with_config(name, bf16, engine_results):
    wrapper, losses = engine_results[f"{name}/{bf16}"]
    assert wrapper == OPTIMIZER_WRAPPER[(name, bf16)]
    assert len(losses) == 4 and all(l == l and l < 1e3 for l in losses)


# --- hostfiles -----------------------------------------------------------------------------------------------

def test_h100_hostfile_parses():
    from deepspeed.launcher.runner import fetch_hostfile

    pool = fetch_hostfile(str(HOSTFILES / "h100"))
    assert list(pool) == [f"h100-node-{i:03d}" for i in range(1, 65)]
    assert set(pool.values()) == {8} and sum(pool.values()) == 512
    text = (HOSTFILES / "h100").read_text()
    assert text.startswith("#") and ".deepspeed_env" in text and "ssh" in text


def test_localhost_hostfile_parses():
    from deepspeed.launcher.runner import fetch_hostfile

    assert dict(fetch_hostfile(str(HOSTFILES / "localhost"))) == {"localhost": 8}


def test_hostfile_parser_only_skips_hash_comments(tmp_path):
    """Why the comment blocks start every line with '#': any other free text is a 'bad entry'."""
    from deepspeed.launcher.runner import fetch_hostfile

    bad = tmp_path / "hostfile"
    bad.write_text("; not a comment\nnode-1 slots=8\n")
    with pytest.raises(ValueError, match="bad entry"):
        fetch_hostfile(str(bad))


def test_user_json_without_timers_gets_no_per_micro_batch_synchronisation(tmp_path):
    """DeepSpeed's throughput timer (on by default) synchronises the GPU at every micro-batch; the trainer turns
    it off unless the user's JSON configures it."""
    from llmjp_ds.config import load_config
    from llmjp_ds.parallel.ds_config import build_ds_config
    from llmjp_ds.parallel.layout import Layout

    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    kept = tmp_path / "kept.json"
    kept.write_text(json.dumps({"timers": {"throughput": {"enabled": True, "synchronized": False}}}))
    for path, want in ((bare, {"throughput": {"enabled": False}}),
                       (kept, {"throughput": {"enabled": True, "synchronized": False}})):
        cfg = load_config(None, [f"parallel.ds_config={path}", "logging.wandb=disabled"], "demo")
        assert build_ds_config(cfg, Layout(1))["timers"] == want
