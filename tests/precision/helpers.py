"""What the in-process precision tests share: a schedule of given phases, the tiny torch-backend model."""

from __future__ import annotations

import torch

from llmjp_ds.config import PhaseConfig, PrecisionConfig
from llmjp_ds.precision.recipes import validate_phases
from llmjp_ds.precision.schedule import PrecisionSchedule


def schedule(phases, tokens_per_step=1000, **kw):
    cfg = PrecisionConfig(dtype="fp32", phases=[PhaseConfig(**p) for p in phases], emulate_fp8=True, **kw)
    validate_phases(cfg, num_layers=4)
    return PrecisionSchedule(cfg, backend="torch", tokens_per_step=tokens_per_step)


def tiny_model(schedule=None, **kw):
    """The tiny torch-backend model; with ``schedule``, attached to it as the trainer attaches it."""
    from llmjp_ds.model import LlamaForCausalLM, model_config
    from llmjp_ds.model.backend import layers_module

    torch.manual_seed(0)
    config = model_config("tiny", hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          ffn_hidden_size=128, vocab_size=256)
    checkpoint_fn = None if schedule is None else schedule.checkpoint_function(layers_module("torch").checkpoint)
    model = LlamaForCausalLM(config, backend="torch", checkpoint_fn=checkpoint_fn, **kw)
    if schedule is not None:
        schedule.attach(model, model.model.layers, config.num_hidden_layers)
    return model
