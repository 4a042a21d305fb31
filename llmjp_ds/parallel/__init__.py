"""The parallel wiring: how a run's ranks are laid out, DeepSpeed's config, building the model or pipeline on
them, the step runners, and every use of DeepSpeed internals.

* :mod:`.layout`: the factorisation world = pipeline x data (x tensor), pure arithmetic;
* :mod:`.context`: starting torch.distributed and the process groups the rest asks for;
* :mod:`.ds_config`: DeepSpeed's JSON, filled from the run config;
* :mod:`.build`: the model or the pipeline, seeded per layer, HF weights loaded into it, the engine;
* :mod:`.grad_accumulation`: one-pass fp32 gradient accumulation inside DeepSpeed's BF16 optimizer;
* :mod:`.runners`: one step runner per engine kind, behind one interface.
"""
