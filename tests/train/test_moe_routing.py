"""What a person watches of an MoE run, from ``tiny-moe`` CPU trainings (one process, the tiny fp32 setup of
``tests/runs.py``: 8 sequences of 32 tokens a step, two MoE layers of 8 experts, 2 a token).

* The routing fields of each step's record agree with each other and with the step: every layer's loads sum to
  the step's tokens x experts a token (8 x 32 x 2 = 512), each layer's imbalance is its ``max / mean`` of the logged
  matrix, the least-loaded expert and its tokens are the matrix's, the run's imbalance is the largest layer's,
  and the matrix is logged every ``logging.expert_load_interval`` steps and at the last; the step line shows the
  record's load-balancing loss.
* A run whose first MoE layer can never choose one expert (its router row zero and the others' on a circle of the
  only two dimensions the layer's RMSNorm lets through, so every token's top two logits are positive and that
  expert's is 0: a start given through ``model.init_from_hf``) records that expert with no token in every step,
  and the router-collapse rule answers it: under ``health.router.action=warn`` an event at ``starved_steps`` and
  again as many steps later, listed by ``llmjp-ds health``; under ``stop`` the run ends at ``starved_steps`` with
  one line and a non-zero exit, the record's ``stop`` event holding that line. The run of the same setup from the
  seeded start (every expert gets tokens) raises no such event. ``llmjp-ds plot``'s heat map of the starved run is
  its last logged matrix, the starved expert a 0.
"""

from __future__ import annotations

import math

import pytest
import torch

from llmjp_ds.metrics.plot import run_figure
from llmjp_ds.metrics.record import read_metrics

from tests.launch import free_port, run_command, subprocess_env, train_argv
from tests.runs import COMMON_SETS, run_train, trail
from tests.train.test_health import health_report

pytestmark = pytest.mark.slow

MOE = ("model.shape=tiny-moe", "logging.expert_load_interval=2")
STEPS, SEQUENCES, SEQ_LEN, LAYERS, EXPERTS, TOP_K = 5, 8, 32, 2, 8, 2
STARVED = 5  # the expert of MoE layer 0 that never gets a token


def starved_start(path, run_dir) -> str:
    """An HF directory of the runs' model whose MoE layer 0 never routes a token to expert ``STARVED``."""
    from llmjp_ds.config import load_config, model_config_of
    from llmjp_ds.model import LlamaForCausalLM

    config = model_config_of(load_config(None, [f"run_dir={run_dir}", *COMMON_SETS, *MOE]))
    assert (config.num_hidden_layers, config.num_experts, config.num_experts_per_tok) == (LAYERS, EXPERTS, TOP_K)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config, backend="torch")
    weights = model.state_dict()
    norm, router = weights["model.layers.0.moe.norm.weight"], weights["model.layers.0.moe.router.weight"]
    norm.zero_()
    norm[:2] = 10.0  # the router sees each token's first two normalised dimensions only
    router[STARVED].zero_()
    others = [e for e in range(EXPERTS) if e != STARVED]
    for i, expert in enumerate(others):  # 7 points on a circle: any direction's two nearest lie within 2 x 360/7 deg
        angle = 2 * math.pi * i / len(others)
        router[expert, :2] = torch.tensor([5 * math.cos(angle), 5 * math.sin(angle)])
    model.load_state_dict(weights)
    model.save_pretrained(path, dtype=torch.float32)
    return str(path)


@pytest.fixture(scope="module")
def moe_runs(train_env, tmp_path_factory):
    """The seeded run, the starved run under warn (starved_steps 2: events at steps 2 and 4), both of ``STEPS``
    steps, and the starved run's launch under stop (its temp directory and result)."""
    root = tmp_path_factory.mktemp("moe-routing")
    hf = starved_start(root / "starved-hf", root / "x")
    seeded = run_train(root / "seeded", 1, *MOE, f"train.steps={STEPS}", "health.router.starved_steps=2")
    warned = run_train(root / "warned", 1, *MOE, f"train.steps={STEPS}", f"model.init_from_hf={hf}",
                       "health.router.starved_steps=2")
    port = free_port()
    stopped = run_command(train_argv(root / "stopped" / "run", COMMON_SETS, *MOE, f"train.steps={STEPS}",
                                     f"model.init_from_hf={hf}", "health.router.starved_steps=2",
                                     "health.router.action=stop"),
                          root / "stopped" / "train", env=subprocess_env(MASTER_PORT=port), check=False,
                          timeout=300)
    return {"seeded": seeded, "warned": warned, "stopped": (root / "stopped", stopped)}


def assert_consistent(record: dict) -> None:
    """The routing fields of one step's record against each other and against its matrix (when logged)."""
    layers = record["moe_layer_imbalance"]
    assert len(layers) == len(record["moe_min_load"]) == len(record["moe_least_loaded"]) == LAYERS
    assert record["moe_imbalance"] == max(layers) and all(x >= 1.0 for x in layers)
    assert record["moe_dropped_tokens"] == 0  # dropless
    assert math.isfinite(record["moe_aux_loss"]) and record["moe_aux_loss"] > 0
    assert math.isfinite(record["moe_z_loss"]) and record["moe_z_loss"] > 0
    loads = record.get("moe_expert_load")
    if loads is None:
        return
    assert [len(layer) for layer in loads] == [EXPERTS] * LAYERS
    for i, layer in enumerate(loads):
        assert sum(layer) == record["global_batch_size"] * SEQ_LEN * TOP_K == SEQUENCES * SEQ_LEN * TOP_K
        assert layers[i] == pytest.approx(max(layer) / (sum(layer) / EXPERTS), rel=1e-12)
        assert record["moe_min_load"][i] == min(layer)
        assert record["moe_least_loaded"][i] == layer.index(min(layer))


def router_events(run_dir) -> list[tuple]:
    return [(e["step"], e["action"], e["where"], e["value"]) for e in read_metrics(run_dir)
            if e.get("event") == "health" and e.get("kind") == "router"]


def test_an_moe_runs_records_carry_its_routing_consistently(moe_runs):
    run_dir = moe_runs["seeded"]
    records = trail(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for record in records:
        assert_consistent(record)
    assert [r["step"] for r in records if "moe_expert_load" in r] == [2, 4, 5]  # every 2 steps, and the last
    assert router_events(run_dir) == []  # the seeded routers feed every expert
    out = (run_dir.parent / "train-01.out").read_text()
    for record in records:  # the step line shows the record's load-balancing loss
        assert f"step {record['step']}/{STEPS} | loss {record['loss']:.4f} z {record['z_loss']:.2e} aux " \
               f"{record['moe_aux_loss']:.3f} | " in out, out[-2000:]


def test_an_expert_without_tokens_is_a_router_collapse_warned_and_listed(moe_runs, tmp_path):
    run_dir = moe_runs["warned"]
    records = trail(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for record in records:
        assert_consistent(record)
        assert record["moe_min_load"][0] == 0 and record["moe_least_loaded"][0] == STARVED
        assert record.get("moe_expert_load", [[0] * EXPERTS])[0][STARVED] == 0
        assert record["moe_min_load"][1] > 0  # the other layer's routers are the seeded ones
    where = f"expert {STARVED} of MoE layer 0"
    assert router_events(run_dir) == [(2, "warn", where, 2.0), (4, "warn", where, 2.0)]
    rows, counts = health_report(run_dir, tmp_path)
    assert rows == [("2", "router collapse", f"warn: {where} got no token for 2 steps"),
                    ("4", "router collapse", f"warn: {where} got no token for 2 steps")], rows
    assert counts.startswith(f"{STEPS} steps logged, 0 rollbacks, 0 updates skipped;"), counts
    logs = (run_dir.parent / "train-01.out").read_text() + (run_dir.parent / "train-01.err").read_text()
    assert f"warning: a router collapse at step 2: {where} got no token for 2 steps" in logs

    # llmjp-ds plot: the heat map is the last logged matrix (step 5's) as shares, the starved expert a 0
    (image,) = [im for ax in run_figure(run_dir).axes for im in ax.images]
    last = records[-1]["moe_expert_load"]
    assert image.axes.get_title().startswith(f"expert load at step {STEPS} ")
    assert image.get_array().tolist() == [[n / (sum(layer) / EXPERTS) for n in layer] for layer in last]
    assert image.get_array()[0, STARVED] == 0


def test_a_router_collapse_under_stop_ends_the_run_with_one_line(moe_runs, tmp_path):
    root, result = moe_runs["stopped"]
    assert result.returncode != 0, result.stdout[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    where = f"expert {STARVED} of MoE layer 0"
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert lines[0] == (f"error: a router collapse at step 2: {where} got no token for 2 steps; health.router.action "
                        "is stop: the run ends here, and no checkpoint is its latest checkpoint; look at the data "
                        "around it, or choose another action")
    run_dir = root / "run"
    assert [r["step"] for r in trail(run_dir)] == [1]  # the stopped step is not recorded as trained
    assert router_events(run_dir) == [(2, "stop", where, 2.0)]
    (stop,) = [e for e in read_metrics(run_dir) if e.get("event") == "stop"]
    assert stop["step"] == 2 and stop["reason"] == lines[0].removeprefix("error: ")
    rows, _ = health_report(run_dir, tmp_path)
    assert [r[:2] for r in rows] == [("2", "router collapse"), ("2", "the run stopped")], rows
