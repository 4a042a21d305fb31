"""The run config: one typed tree of dataclasses, named presets, YAML/JSON files and ``--set key=value``.

* :mod:`.schema`: the sections and their fields, each with what it may hold;
* :mod:`.rules`: how a field declares its valid range, choices or path (:class:`Valid`, :class:`PathRule`);
* :mod:`.presets`: the named run presets (the demo, LLM-jp-3's and LLM-jp-4's recipes);
* :mod:`.load`: a preset, a file and ``--set`` merged and built by pydantic, every mistake one line; the shared
  ``--config/--preset/--set`` flags;
* :mod:`.derived`: what follows from a config (its samples, its model's config, its saves, its stop signals).

Everything that must agree across sections is checked by :func:`llmjp_ds.validate.validate_run` before any
process group or GPU memory exists. DeepSpeed's own JSON (``ds_configs/``) stays DeepSpeed's;
:mod:`llmjp_ds.parallel.ds_config` fills its batch, clipping and dtype keys from this config.
"""

from llmjp_ds.config.derived import (blend_history, check_keep_rules, kept_step, megatron_sample_counts,
                                     model_config_of, model_options_of, sample_counts, save_due, seq_len_of,
                                     sequence_parallel_of,
                                     stop_signals_of, train_samples)
from llmjp_ds.config.load import (add_config_args, apply_set, build_config, config_from_args, load_config, load_file,
                                  merge, parse_value)
from llmjp_ds.config.presets import LLMJP_LOG_SPACED, RUN_PRESETS, preset_dict
from llmjp_ds.config.rules import REPO_ROOT, PathRule, Valid
from llmjp_ds.config.schema import (DECAY_STYLES, RECOMPUTE_MODES, RESUME_SCHEDULES, WEIGHT_DECAY_INCR_STYLES,
                                    WSD_DECAY_STYLES, BatchChange, CheckpointConfig, DataConfig, DataPhase,
                                    GuardConfig, HealthConfig, KeepRule, LoggingConfig, ModelConfig, OptimConfig,
                                    ParallelConfig, PhaseConfig, PrecisionConfig, RunConfig, SpikeRule, TrainConfig)

__all__ = ["DECAY_STYLES", "LLMJP_LOG_SPACED", "RECOMPUTE_MODES", "REPO_ROOT", "RESUME_SCHEDULES", "RUN_PRESETS",
           "WEIGHT_DECAY_INCR_STYLES", "WSD_DECAY_STYLES", "BatchChange", "CheckpointConfig", "DataConfig",
           "DataPhase", "GuardConfig", "HealthConfig", "KeepRule", "LoggingConfig", "ModelConfig", "OptimConfig",
           "ParallelConfig", "PathRule", "PhaseConfig", "PrecisionConfig", "RunConfig", "SpikeRule", "TrainConfig",
           "Valid", "add_config_args", "apply_set", "blend_history", "build_config", "check_keep_rules",
           "config_from_args", "kept_step", "load_config", "load_file", "megatron_sample_counts", "merge",
           "model_config_of", "model_options_of", "parse_value", "preset_dict", "sample_counts", "save_due",
           "seq_len_of",
           "sequence_parallel_of", "stop_signals_of", "train_samples"]
