"""An MoE step's routing as the record keeps it (``llmjp_ds/metrics/experts.py``), against loads worked out by hand:
the imbalance of each layer (``max / mean``), the least-loaded expert and its tokens, the starved experts, and the
whole matrix only when it is asked for."""

from __future__ import annotations

import json

from llmjp_ds.metrics.experts import routing_metrics, starved_experts
from llmjp_ds.parallel.runners import Routing

# two MoE layers of four experts, 8 tokens x 2 experts each = 16 choices a layer (mean 4)
LOADS = [[8, 0, 4, 4], [3, 3, 3, 7]]


def test_the_records_routing_fields_are_the_loads_arithmetic():
    routing = Routing(aux_loss=1.25, z_loss=3.5, dropped=2, expert_load=LOADS)
    got = routing_metrics(routing, with_loads=False)
    assert got == {"moe_aux_loss": 1.25, "moe_z_loss": 3.5, "moe_dropped_tokens": 2,
                   "moe_imbalance": 2.0,  # layer 0: 8 / 4; layer 1: 7 / 4
                   "moe_layer_imbalance": [2.0, 1.75],
                   "moe_min_load": [0, 3],
                   "moe_least_loaded": [1, 0]}  # a tie goes to the lowest expert
    assert json.loads(json.dumps(got)) == got  # a record's line as it is written
    with_loads = routing_metrics(routing, with_loads=True)
    assert with_loads == {**got, "moe_expert_load": LOADS}


def test_an_even_layer_is_1_and_a_layer_without_tokens_is_0():
    got = routing_metrics(Routing(1.0, 0.0, 0, [[4, 4, 4, 4], [0, 0, 0, 0]]), with_loads=False)
    assert got["moe_layer_imbalance"] == [1.0, 0.0] and got["moe_imbalance"] == 1.0
    assert got["moe_min_load"] == [4, 0] and got["moe_least_loaded"] == [0, 0]


def test_starved_experts_are_those_of_no_token():
    assert starved_experts(LOADS) == [(0, 1)]
    assert starved_experts([[0, 5, 0], [2, 2, 2], [0, 0, 6]]) == [(0, 0), (0, 2), (2, 0), (2, 1)]
    assert starved_experts([[1, 1], [1, 1]]) == []
