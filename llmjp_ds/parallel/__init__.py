"""The parallel wiring: how a run's ranks are laid out, DeepSpeed's config, building the model or pipeline on
them, the step runners, and every use of DeepSpeed internals.

* :mod:`.layout`: the factorisation world = pipeline x data (x tensor), pure arithmetic;
* :mod:`.context`: starting torch.distributed and the process groups the rest asks for;
* :mod:`.ds_config`: DeepSpeed's JSON, filled from the run config;
* :mod:`.build`: the model or the pipeline, seeded per layer, HF weights loaded into it, the engine;
* :mod:`.deepspeed_internals`: every use of DeepSpeed's internals (one-pass fp32 gradient accumulation in its
  BF16 optimizer; its ZeRO-1 checkpoint format and optimizer state; its expert groups and MoE engine, for expert
  parallelism);
* :mod:`.stages`: the model as DeepSpeed's pipeline of layers, and its parameter names;
* :mod:`.runners`: one step runner per engine kind, behind one interface;
* :mod:`.reshape`: resuming a checkpoint on another layout (data, pipeline, tensor or expert-parallel size);
* :mod:`.memory`: the per-stage memory of a layout (what preflight estimates).
"""
