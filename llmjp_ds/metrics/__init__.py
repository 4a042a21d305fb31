"""What a run measures and how a person sees it.

* :mod:`.logger`: throughput and MFU, peak memory, ``metrics.jsonl`` and wandb, the progress line;
* :mod:`.experts`: an MoE model's routing in a step's record: losses, drops, each layer's load balance;
* :mod:`.record`: ``metrics.jsonl`` read back across its attempts: every event, each step's current record;
* :mod:`.curves`: loss curves of llmjp-ds and Megatron-LM runs read into one form, and the gap between two;
* :mod:`.plot`: ``llmjp-ds plot``: a run's curves to PNG, precision phases shaded and events marked, beside others.

Import the modules themselves (``plot`` loads matplotlib, which the logger does not need).
"""
