"""DeepSpeed initialisation from the run config: ZeRO 0-3 on the HF model, or a pipeline of the same layers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from llmjp_ds.config import REPO_ROOT, RunConfig, gradient_accumulation_steps
from llmjp_ds.errors import fail


def ds_config_path(cfg: RunConfig) -> Path:
    if cfg.parallel.ds_config:
        return Path(cfg.parallel.ds_config)
    name = "pipeline.json" if cfg.parallel.pipeline_stages > 1 else f"zero{cfg.parallel.zero_stage}.json"
    return REPO_ROOT / "ds_configs" / name


def build_ds_config(cfg: RunConfig, world_size: int) -> dict:
    """DeepSpeed's JSON with the values that must agree with the run config filled in from it."""
    path = ds_config_path(cfg)
    if path.is_file():
        try:
            ds = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            fail(f"DeepSpeed config {path} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}): "
                 "fix the file, or leave parallel.ds_config unset for the bundled ds_configs/")
        if not isinstance(ds, dict):
            fail(f"DeepSpeed config {path} must hold a JSON object, not a {type(ds).__name__}: see ds_configs/")
    elif cfg.parallel.ds_config:
        fail(f"DeepSpeed config {path} does not exist: pass an existing file as parallel.ds_config")
    else:
        ds = {}
    bf16 = cfg.precision.dtype == "bf16"
    ds["train_batch_size"] = cfg.train.global_batch_size
    ds["train_micro_batch_size_per_gpu"] = cfg.train.micro_batch_size
    ds["gradient_accumulation_steps"] = gradient_accumulation_steps(cfg, world_size)
    ds["gradient_clipping"] = cfg.optim.clip_grad
    ds["bf16"] = {**ds.get("bf16", {}), "enabled": bf16}
    ds.pop("fp16", None)
    ds["zero_optimization"] = {**ds.get("zero_optimization", {}), "stage": cfg.parallel.zero_stage}
    if cfg.parallel.pipeline_stages > 1 and bf16:
        ds["data_types"] = {**ds.get("data_types", {}), "grad_accum_dtype": "fp32"}
    ds.setdefault("steps_per_print", 1 << 30)  # the trainer logs; DeepSpeed stays quiet
    ds.setdefault("wall_clock_breakdown", False)
    # DeepSpeed's throughput timer synchronises the GPU at every micro-batch's forward and step, which keeps the
    # host from queueing the next micro-batch while the GPU runs this one; the trainer measures throughput itself
    ds.setdefault("timers", {"throughput": {"enabled": False}})
    for key in ("optimizer", "scheduler"):
        if key in ds:
            fail(f"{path} has an {key!r} block: llmjp-ds passes its own AdamW and LR schedule; remove the block "
                 "and set optim.* in the run config")
    return ds


def init_distributed() -> None:
    import deepspeed

    if "WORLD_SIZE" not in os.environ and "MASTER_PORT" not in os.environ:
        # a lone process (python -m llmjp_ds.train, llmjp-ds demo): its rendezvous port is private, so take a free
        # one rather than 29500, which another job on a shared machine may hold (EADDRINUSE at startup)
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for key, default in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                         ("MASTER_PORT", "29500")):
        os.environ.setdefault(key, default)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")


def build_model(cfg: RunConfig, model_config, backend: str):
    """The HF model (no pipeline) or a ``PipelineModule`` of the same layer classes."""
    from llmjp_ds.model import LlamaForCausalLM

    loss_kwargs = {"z_loss_coeff": cfg.model.z_loss, "fused_loss": cfg.model.fused_loss and torch.cuda.is_available()}
    fp8_head = cfg.precision.fp8_lm_head
    if cfg.parallel.pipeline_stages == 1:
        if cfg.model.init_from_hf:
            model = LlamaForCausalLM.from_pretrained(cfg.model.init_from_hf, backend=backend,
                                                     dtype=torch.float32, fp8_lm_head=fp8_head, **loss_kwargs)
        else:
            model = LlamaForCausalLM(model_config, backend=backend, fp8_lm_head=fp8_head, **loss_kwargs)
            init_like_pipeline(model, model_config, backend, cfg.train.seed, fp8_head)
        model.activation_checkpointing = cfg.model.activation_checkpointing
        return model, None
    from llmjp_ds.model.backend import layers_module
    from llmjp_ds.model.pipeline import PipelineLoss, flops_weights, pipeline_module_class

    loss = PipelineLoss(cfg.model.z_loss, loss_kwargs["fused_loss"])
    ckpt = cfg.model.activation_checkpointing
    module = pipeline_module_class()(
        layers=seeded_layer_specs(model_config, backend, cfg.train.seed, fp8_head),
        num_stages=cfg.parallel.pipeline_stages,
        loss_fn=loss,
        partition_method=cfg.parallel.partition_method,
        partition_weights=flops_weights(model_config, cfg.data.seq_len or model_config.max_position_embeddings),
        activation_checkpoint_interval=1 if ckpt else 0,
        activation_checkpoint_func=layers_module(backend).checkpoint,
        checkpointable_layers=["DecoderLayerPipe"])
    if cfg.model.init_from_hf:
        load_hf_into_pipeline(module, cfg.model.init_from_hf, model_config)
    return module, loss


def _layer_seed(seed: int, layer_index: int) -> int:
    return (seed << 20) + layer_index


def seeded_layer_specs(model_config, backend: str, seed: int, fp8_head: bool = False) -> list:
    """The pipeline's layer specs, each built right after seeding torch with (seed, its index): a stage builds
    only its own layers, so without this its weights would depend on where the partition cuts (and differ
    from the single-process model built from the same seed)."""
    from deepspeed.pipe import LayerSpec

    from llmjp_ds.model.pipeline import layer_specs

    class SeededLayerSpec(LayerSpec):
        def __init__(self, spec, layer_seed: int):
            super().__init__(spec.typename, *spec.module_args, **spec.module_kwargs)
            self.layer_seed = layer_seed

        def build(self, log=False):
            torch.manual_seed(self.layer_seed)
            return super().build(log)

    return [SeededLayerSpec(spec, _layer_seed(seed, i))
            for i, spec in enumerate(layer_specs(model_config, backend, fp8_head=fp8_head))]


def init_like_pipeline(model, model_config, backend: str, seed: int, fp8_head: bool = False) -> None:
    """Give the single-model layout the weights any pipeline layout builds from the same seed (layer by layer,
    see :func:`seeded_layer_specs`), so runs on different layouts start from the same model."""
    from llmjp_ds.model.pipeline import pipeline_to_hf_names

    n = model_config.num_hidden_layers
    for idx, spec in enumerate(seeded_layer_specs(model_config, backend, seed, fp8_head)):
        layer = spec.build()
        state = {pipeline_to_hf_names(idx, n, name): tensor for name, tensor in layer.state_dict().items()
                 if not name.endswith("_extra_state")}
        result = model.load_state_dict(state, strict=False)
        if result.unexpected_keys:
            raise RuntimeError(f"pipeline layer {idx} does not map onto the model: {result.unexpected_keys[:3]}")
        del layer


def load_hf_into_pipeline(module, hf_dir: str, model_config) -> None:
    from llmjp_ds.model.hf_adapter import from_hf_state_dict
    from llmjp_ds.model.hf_io import read_hf_tensors
    from llmjp_ds.model.pipeline import pipeline_to_hf_names

    ours = from_hf_state_dict(read_hf_tensors(Path(hf_dir)), model_config)
    n = model_config.num_hidden_layers
    for idx, layer in zip(range(module._local_start, module._local_stop), module.forward_funcs):
        state = {name: ours[pipeline_to_hf_names(idx, n, name)]
                 for name in layer.state_dict() if not name.endswith("_extra_state")}
        layer.load_state_dict(state, strict=False)


def initialize(cfg: RunConfig, model, world_size: int):
    import deepspeed

    from llmjp_ds.optim import build_optimizer

    # fp32 + ZeRO-0 is the one layout where DeepSpeed steps our AdamW directly, with no overflow check: a
    # non-finite step must still be skipped (and reported through was_step_applied) there
    plain = cfg.parallel.zero_stage == 0 and cfg.precision.dtype == "fp32"
    optimizer = build_optimizer(model, cfg.optim, skip_nonfinite=plain)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=build_ds_config(cfg, world_size))
    if cfg.parallel.fused_grad_accumulation:
        fuse_grad_accumulation(engine.optimizer, engine.module.modules())
    return engine


def fuse_grad_accumulation(optimizer, modules) -> int:
    """FP32 gradient accumulation in one pass, for DeepSpeed's ``BF16_Optimizer`` (bf16 + ZeRO-1 or pipeline
    with ``grad_accum_dtype`` fp32, ``ds_configs/zero1.json`` and ``pipeline.json``).

    Per micro-batch and parameter DeepSpeed casts the bf16 gradient to a new fp32 tensor and then adds it to the
    fp32 buffer: two kernels and 22 bytes of memory traffic per parameter, 17 % of a 172B-slice step on an H200
    (docs/performance.md). Here (1) that add reads the bf16 gradient directly (``add_`` promotes inside the
    kernel: one pass, 10 bytes, the same fp32 result bit for bit), and (2) with ``immediate_grad_update`` the
    weights a module lists in ``MAIN_GRAD_WEIGHTS`` (TE's GEMM weights in ``te_layers``; the embedding and LM
    head in ``model/main_grad.py``) get DeepSpeed's fp32 buffer as ``main_grad`` and ``fuse_wgrad_accumulation``:
    the module's backward accumulates into it in fp32 (no bf16 rounding of each micro-batch's gradient) and
    returns a placeholder, which the hook drops. Returns the number of weights accumulated that way."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    if not isinstance(optimizer, BF16_Optimizer):
        return 0
    internals = ("_update_hp_grad", "fp32_groups_gradients", "fp32_groups_has_gradients", "bf16_groups",
                 "immediate_grad_update")
    if not all(hasattr(optimizer, name) for name in internals):  # written against DeepSpeed 0.19's BF16_Optimizer
        print("[llmjp-ds] this DeepSpeed's BF16_Optimizer lacks the fields parallel.fused_grad_accumulation "
              "uses: accumulating gradients DeepSpeed's way", flush=True)
        return 0
    hp_grads, has_grads = optimizer.fp32_groups_gradients, optimizer.fp32_groups_has_gradients

    @torch.no_grad()
    def update_hp_grad(lp, group_idx, param_idx, clear_lp_grads):
        if lp.grad is None:
            return
        hp = hp_grads[group_idx][param_idx]
        if getattr(lp, "grad_added_to_main_grad", False):
            lp.grad_added_to_main_grad = False  # the GEMM accumulated into hp; lp.grad is TE's placeholder
        else:
            hp.add_(lp.grad.view(hp.shape))
        lp._hp_grad = hp
        has_grads[group_idx][param_idx] = True
        if clear_lp_grads:
            lp.grad.zero_()

    optimizer._update_hp_grad = update_hp_grad  # what DeepSpeed's grad hooks and update_hp_grads call
    if not optimizer.immediate_grad_update:
        return 0
    where = {id(lp): (i, j) for i, group in enumerate(optimizer.bf16_groups) for j, lp in enumerate(group)}
    fused = 0
    for module in modules:
        names = getattr(module, "MAIN_GRAD_WEIGHTS", ())
        weights = [getattr(module, name) for name in names]
        if not weights or not all(id(w) in where for w in weights):
            continue
        for w in weights:
            i, j = where[id(w)]
            w.main_grad = hp_grads[i][j].view(w.shape)
            w.grad_added_to_main_grad = False
        module.fuse_wgrad_accumulation = True
        fused += len(weights)
    return fused


def data_parallel_info(engine) -> tuple[int, int, object]:
    """(dp rank, dp size, the data-parallel process group: FP8 amax reduction group under pipelines)."""
    import torch.distributed as dist

    grid = getattr(engine, "grid", None)
    if grid is not None:
        return grid.get_data_parallel_rank(), grid.get_data_parallel_world_size(), grid.get_data_parallel_group()
    return dist.get_rank(), dist.get_world_size(), None
