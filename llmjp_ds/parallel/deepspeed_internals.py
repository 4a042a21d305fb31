"""Every use of DeepSpeed's internals, in one place, each named with the DeepSpeed version it was read from.

**One-pass fp32 gradient accumulation** inside DeepSpeed's ``BF16_Optimizer``
(:func:`fuse_grad_accumulation`). The private names, read from DeepSpeed 0.19.8's
``deepspeed/runtime/bf16_optimizer.py``:

* ``_update_hp_grad(lp, group_idx, param_idx, clear_lp_grads)``: the method the grad hooks call to add a bf16
  gradient into the fp32 buffer (replaced here);
* ``fp32_groups_gradients[i][j]``: the fp32 gradient buffer of parameter ``j`` of group ``i``;
* ``fp32_groups_has_gradients[i][j]``: the flag ``get_grads_for_norm`` and the step read;
* ``bf16_groups[i][j]``: the bf16 parameters, in the same order;
* ``immediate_grad_update``: DeepSpeed's ``bf16.immediate_grad_update`` (the hook path);
* ``lp._hp_grad``: the attribute DeepSpeed sets on a bf16 parameter to its fp32 gradient.

If a DeepSpeed lacks any of them the run keeps DeepSpeed's own accumulation and says so in one line.

**The optimizer step in one pass** (:func:`fuse_optimizer_step`), read from the same file's ``step``,
``update_lp_params`` and ``clear_hp_grads``: ``get_grads_for_norm()``, ``norm_type``, ``clip_grad``, ``mpu``,
``fp32_groups_flat_partition`` / ``fp32_groups_gradient_flat_partition`` (each group's flat fp32 weights and
gradients of this rank, the base optimizer's parameters), ``bf16_partitioned_groups[i][rank]`` (the bf16 slice
they update), ``bf16_groups_flat``, ``real_dp_process_group``, ``nccl_start_alignment_factor`` and
``allgather_bucket_size`` (for ``runtime/utils.py``'s ``all_gather_dp_groups``), ``overflow`` and
``_global_grad_norm`` (what the engine reads back), ``clear_hp_grads`` / ``clear_lp_grads`` and
``_lazy_init_hp_params_optimizer_state``.

**The ZeRO-1 checkpoint format and optimizer state**, for a resume on another layout (``parallel/reshape.py``),
read from DeepSpeed 0.19.8's ``runtime/zero/stage_1_and_2.py``, ``runtime/bf16_optimizer.py`` and
``checkpoint/constants.py``:

* the files ``[bf16_]zero_pp_rank_{dp}_mp_rank_{pp:02d}_optim_states.pt`` and ``mp_rank_{pp:02d}_model_states.pt``;
* in an optimizer file's ``optimizer_state_dict``: ``single_partition_of_fp32_groups`` (the rank's flat fp32
  slice per group), ``param_slice_mappings`` (name -> ``fragment_address(start, numel)`` in that slice) and
  ``base_optimizer_state`` (torch's AdamW state of the slices: ``step``, ``exp_avg``, ``exp_avg_sq``); in a model
  file, ``param_shapes`` (name -> shape per group);
* in a live ZeRO-1 / BF16 optimizer: its flat slices (``single_partition_of_fp32_groups`` /
  ``fp32_groups_flat_partition``), its base ``optimizer.state``, and ``_lazy_init_hp_params_optimizer_state`` with
  ``_hp_optimizer_states_linked``, which link each parameter to its slice of the Adam moments (what
  ``deepspeed.utils.safe_set_full_optimizer_state`` writes through).

**Checkpoint file I/O** (:func:`route_checkpoint_io`), read from DeepSpeed 0.19.8's ``runtime/engine.py``,
``runtime/pipe/module.py`` and ``runtime/state_dict_factory.py``: the engine writes and reads every file of a
checkpoint (model states, ZeRO optimizer shards, pipeline layer files) through ``engine.checkpoint_engine``'s
``save(state_dict, path)`` and ``load(path, map_location)``; ``TorchCheckpointEngine.load`` calls
``torch.load(weights_only=False)``. The readers of the ZeRO-1 format below take the loader as an argument.

**Checkpoint file names** (:func:`model_states_file`, :data:`MODEL_STATES_GLOB`, :data:`PIPELINE_LAYER_GLOB`,
:func:`pipeline_layer_ranks`, :func:`zero_checkpoint_ranks`), read from DeepSpeed 0.19.8's ``runtime/engine.py``
(``_get_ckpt_name``, ``_get_zero_ckpt_name``) and ``runtime/pipe/module.py`` (``ckpt_layer_path``): what
``checkpoint/`` and ``parallel/reshape.py`` look for in a tag directory.

**The pipeline module** (:func:`pipeline_module_class`, :func:`local_layers`, :func:`partition_balanced`,
:func:`set_stage_forward_context`), read from DeepSpeed 0.19.8's ``runtime/pipe/module.py`` and
``runtime/utils.py``: ``PipelineModule._partition_layers(method)`` (overridden for ``partition_method: flops``),
with ``_layer_specs``, ``_topo``, ``global_rank``, ``num_stages``, ``parts`` and ``_set_bounds(start, stop)``;
``_local_start`` / ``_local_stop`` (this stage's layer indices) beside ``forward_funcs``; ``partition_balanced``.

**The engine's progress counters** (:func:`set_progress`), from DeepSpeed 0.19.8's ``runtime/engine.py``:
``global_steps`` and ``global_samples``, which ``load_checkpoint`` restores and a resume on another layout sets.

**Expert parallelism through DeepSpeed's MoE support** (:func:`expert_parallel_group`,
:func:`expert_parallel_module`, :func:`from_expert_file_key`), read from DeepSpeed 0.19.8's ``utils/groups.py``
(``_create_expert_and_data_parallel``, ``_get_expert_parallel_group``, ``_get_expert_parallel_rank``; groups keyed
``ep_size_<n>``) and ``runtime/engine.py`` (``_configure_distributed_model``, ``_save_moe_checkpoint``,
``load_moe_state_dict``: what each function below says it relies on).
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import torch

from llmjp_ds.model.attach import accumulate_in_main_grad
from llmjp_ds.model.expert_parallel import ExpertParallel
from llmjp_ds.model.hf_adapter import ep_global_name, is_expert_weight
from llmjp_ds.model.kernels import adamw

BF16_OPTIMIZER_INTERNALS = ("_update_hp_grad", "fp32_groups_gradients", "fp32_groups_has_gradients", "bf16_groups",
                            "immediate_grad_update")


def fuse_grad_accumulation(optimizer, modules) -> int:
    """FP32 gradient accumulation in one pass, for DeepSpeed's ``BF16_Optimizer`` (bf16 + ZeRO-1 or pipeline
    with ``grad_accum_dtype`` fp32, ``ds_configs/zero1.json`` and ``pipeline.json``).

    Per micro-batch and parameter DeepSpeed casts the bf16 gradient to a new fp32 tensor and then adds it to the
    fp32 buffer: two kernels and 22 bytes of memory traffic per parameter (its measured cost is in
    docs/performance.md). Here (1) that add reads the bf16 gradient directly (``add_`` promotes inside the
    kernel: one pass, 10 bytes, the same fp32 result bit for bit), and (2) with ``immediate_grad_update`` the
    weights a module lists in ``MAIN_GRAD_WEIGHTS`` (TE's GEMM weights in ``te_layers``; the embedding and LM
    head in ``model/main_grad.py``) get DeepSpeed's fp32 buffer as ``main_grad`` and ``fuse_wgrad_accumulation``:
    the module's backward accumulates into it in fp32 (no bf16 rounding of each micro-batch's gradient) and
    returns a placeholder, which the hook drops. Returns the number of weights accumulated that way."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer  # DeepSpeed 0.19.8

    if not isinstance(optimizer, BF16_Optimizer):
        return 0
    if not all(hasattr(optimizer, name) for name in BF16_OPTIMIZER_INTERNALS):
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

    # DeepSpeed 0.19.8: BF16_Optimizer's grad hooks (immediate_grad_update) and update_hp_grads() call
    # self._update_hp_grad(lp, group_idx, param_idx, clear_lp_grads) once per parameter and micro-batch
    optimizer._update_hp_grad = update_hp_grad
    if not optimizer.immediate_grad_update:
        return 0
    where = {id(lp): (i, j) for i, group in enumerate(optimizer.bf16_groups) for j, lp in enumerate(group)}
    fused = 0
    for module in modules:
        names = getattr(module, "MAIN_GRAD_WEIGHTS", ())
        weights = [getattr(module, name) for name in names]
        if not weights or not all(id(w) in where for w in weights):
            continue
        accumulate_in_main_grad(module, {name: hp_grads[where[id(w)][0]][where[id(w)][1]].view(w.shape)
                                         for name, w in zip(names, weights)})
        fused += len(weights)
    return fused


BF16_STEP_INTERNALS = ("get_grads_for_norm", "fp32_groups_flat_partition", "fp32_groups_gradient_flat_partition",
                       "bf16_partitioned_groups", "bf16_groups_flat", "real_dp_process_group", "clear_hp_grads",
                       "clear_lp_grads", "_lazy_init_hp_params_optimizer_state", "nccl_start_alignment_factor",
                       "allgather_bucket_size", "norm_type", "clip_grad", "mpu")


def fuse_optimizer_step(optimizer) -> bool:
    """DeepSpeed's ``BF16_Optimizer.step`` with the clip, torch's fused AdamW and the bf16 copy of the master
    weights as one Triton pass per parameter group (:mod:`llmjp_ds.model.kernels.adamw`), on CUDA. The rest is
    DeepSpeed's, in its order: the gradient norm (``get_global_norm_of_tensors`` over ``get_grads_for_norm()``),
    the skipped step on a non-finite norm, the all-gather of the bf16 partitions and the gradient reset. Returns
    whether the step was replaced: not for MoE or Muon, bf16 gradient accumulation, or an optimizer other than
    torch's AdamW on CUDA tensors (those keep DeepSpeed's step)."""
    from deepspeed import comm as dist
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer  # DeepSpeed 0.19.8
    from deepspeed.runtime.utils import all_gather_dp_groups, get_global_norm_of_tensors, is_invalid_grad_norm


    if not isinstance(optimizer, BF16_Optimizer):
        return False
    if not all(hasattr(optimizer, name) for name in BF16_STEP_INTERNALS):
        print("[llmjp-ds] this DeepSpeed's BF16_Optimizer lacks the fields optim.fused_step uses: stepping "
              "DeepSpeed's way", flush=True)
        return False
    base = optimizer.optimizer
    if (getattr(optimizer, "has_moe_layers", False) or getattr(optimizer, "_uses_muon", False)
            or optimizer.grad_acc_dtype is not torch.float32 or type(base) is not torch.optim.AdamW
            or any(g.get("amsgrad") or g.get("maximize") for g in base.param_groups)
            or not all(adamw.supported(flat) for flat in optimizer.fp32_groups_flat_partition)):
        return False

    @torch.no_grad()
    def step(closure=None):
        if closure is not None:
            raise NotImplementedError("the fused step takes no closure")
        optimizer.overflow = False
        grads, _ = optimizer.get_grads_for_norm()
        norm = get_global_norm_of_tensors(input_tensors=grads, mpu=optimizer.mpu, norm_type=optimizer.norm_type)
        optimizer._global_grad_norm = norm
        if is_invalid_grad_norm(norm):
            optimizer.overflow = True
            optimizer._global_grad_norm = float("inf")
            optimizer.clear_hp_grads()
            optimizer.clear_lp_grads()
            return
        clip = adamw.clip_factor(norm, optimizer.clip_grad)
        for i, (group, master, grad) in enumerate(zip(base.param_groups, optimizer.fp32_groups_flat_partition,
                                                      optimizer.fp32_groups_gradient_flat_partition)):
            rank = dist.get_rank(group=optimizer.real_dp_process_group[i])
            adamw.adamw_step_(master, grad, base.state[master], optimizer.bf16_partitioned_groups[i][rank], group,
                              clip)
        optimizer._lazy_init_hp_params_optimizer_state()
        # update_lp_params without its copy (the kernel wrote this rank's bf16 partition)
        all_gather_dp_groups(groups_flat=optimizer.bf16_groups_flat,
                             partitioned_param_groups=optimizer.bf16_partitioned_groups,
                             dp_process_group=optimizer.real_dp_process_group,
                             start_alignment_factor=optimizer.nccl_start_alignment_factor,
                             allgather_bucket_size=optimizer.allgather_bucket_size)
        optimizer.clear_hp_grads()

    optimizer.step = step
    return True


# --- the pipeline module ---------------------------------------------------------------------------------------

def partition_balanced(weights: list[float], num_parts: int) -> list[int]:
    """DeepSpeed's linear partition: ``num_parts + 1`` bounds that make the parts' summed weights as even as the
    cuts allow."""
    from deepspeed.runtime.utils import partition_balanced as balanced  # DeepSpeed 0.19.8: runtime/utils.py

    return [int(b) for b in balanced(weights=weights, num_parts=num_parts)]


def pipeline_module_class():
    """``PipelineModule`` whose forward (one micro-batch on this stage) runs inside ``micro_batch_context()``
    (the precision schedule's per-micro-batch context, set once by :func:`set_stage_forward_context`), and which
    knows one more ``partition_method``: ``flops`` cuts the layers where each stage's training FLOPs
    (``partition_weights``, one per layer spec) are most even, so the last stage's head counts; DeepSpeed's
    ``type:`` methods count decoder layers only."""
    from deepspeed.pipe import PipelineModule

    class PrecisionPipelineModule(PipelineModule):
        micro_batch_context = staticmethod(contextlib.nullcontext)

        def __init__(self, *args, partition_weights=None, **kwargs):
            object.__setattr__(self, "_partition_weights", partition_weights)
            super().__init__(*args, **kwargs)

        # DeepSpeed 0.19.8: PipelineModule.__init__ calls self._partition_layers(method=partition_method), which
        # sets self.parts and this stage's bounds through self._set_bounds(start, stop)
        def _partition_layers(self, method="uniform"):
            if method.lower() != "flops":
                return super()._partition_layers(method)
            if self._partition_weights is None or len(self._partition_weights) != len(self._layer_specs):
                raise ValueError("partition_method 'flops' needs partition_weights, one per layer spec")
            self.parts = partition_balanced(self._partition_weights, self.num_stages)
            stage = self._topo.get_coord(self.global_rank).pipe
            if self.global_rank == 0:
                print(f"[llmjp-ds] pipeline stages by training FLOPs: layer specs {self.parts}", flush=True)
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

        def forward(self, forward_input):
            with self.micro_batch_context():
                return super().forward(forward_input)

    return PrecisionPipelineModule


def set_stage_forward_context(engine, context) -> None:
    """Run every forward the pipeline engine makes of its stage module (one micro-batch) inside ``context()``."""
    engine.module.micro_batch_context = context


def local_layers(module) -> list[tuple[int, torch.nn.Module]]:
    """(layer spec index, built module) of each layer this pipeline stage holds."""
    # DeepSpeed 0.19.8: PipelineModule._local_start / _local_stop bound this stage's slice of the layer specs,
    # whose built modules are forward_funcs in the same order
    return list(zip(range(module._local_start, module._local_stop), module.forward_funcs))


# --- the engine's progress counters ---------------------------------------------------------------------------

def set_progress(engine, steps: int, samples: int) -> None:
    """The engine's own count of optimizer steps and samples (what ``load_checkpoint`` restores)."""
    engine.global_steps, engine.global_samples = steps, samples  # DeepSpeed 0.19.8: runtime/engine.py


def set_global_batch(engine, batch: int) -> None:
    """A new global batch from the next step on (a ramp or a change): ``set_train_batch_size`` sets the gradient
    accumulation (and the pipeline's micro-batches), and the engine's micro-step count restarts, since its optimizer
    step comes when ``(micro_steps + 1) % gradient_accumulation_steps() == 0`` (DeepSpeed 0.19.8:
    runtime/engine.py ``is_gradient_accumulation_boundary``), a count the old accumulation left at a multiple of
    the old one."""
    engine.set_train_batch_size(batch)
    engine.micro_steps = 0


# --- checkpoint file names --------------------------------------------------------------------------------------

# DeepSpeed 0.19.8: runtime/engine.py _get_ckpt_name (model states, per model-parallel rank) and
# runtime/pipe/module.py ckpt_layer_path (one file per pipeline layer, -model_{tp:02d} under TP)
MODEL_STATES_GLOB = "mp_rank_*_model_states.pt"
PIPELINE_LAYER_GLOB = "layer_*-model_*states.pt"


def model_states_file(mp_rank: int = 0) -> str:
    """The model-states file of model-parallel rank ``mp_rank`` (rank 0's holds the client state)."""
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def pipeline_layer_ranks(name: str) -> tuple[int, int]:
    """(layer index, TP rank) of a pipeline layer file, ``layer_XX-model_states.pt`` or
    ``layer_XX-model_YY-model_states.pt``."""
    parts = name.split("-")
    layer = int(parts[0].split("_")[1])
    return layer, (int(parts[1].split("_")[1]) if len(parts) == 3 else 0)


# --- the ZeRO-1 checkpoint format, for a resume on another layout ---------------------------------------------

# DeepSpeed 0.19.8: runtime/engine.py _get_zero_ckpt_name (bf16_ before the BF16_Optimizer's)
_OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def zero_checkpoint_ranks(tag_dir) -> list[tuple[int, int]]:
    """(data-parallel rank, model-parallel rank) of every ZeRO optimizer file in a checkpoint directory (the
    model-parallel rank is the pipeline stage without tensor parallelism)."""
    found = [_OPTIM_FILE.match(f.name) for f in Path(tag_dir).iterdir()]
    return [(int(m.group(1)), int(m.group(2))) for m in found if m]


def route_checkpoint_io(engine, load, save) -> None:
    """Make ``engine`` read every checkpoint file with ``load(path, map_location)`` and write it with
    ``save(state, path)``."""
    io = engine.checkpoint_engine
    io.load = lambda path, map_location=None: load(path, map_location=map_location or "cpu")
    io.save = lambda state_dict, path: save(state_dict, path)


def _optim_state(path, load) -> dict:
    return load(path)["optimizer_state_dict"]


def zero_checkpoint_step(tag_dir, load) -> torch.Tensor:
    """The optimizer step of a ZeRO-1 checkpoint (AdamW's ``step``, the same in every group and rank), its files
    read with ``load(path)``."""
    path = next(Path(tag_dir).glob("*zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    return _optim_state(path, load)["base_optimizer_state"]["state"][0]["step"]


def zero_checkpoint_params(tag_dir, stages: int, data: int, tensor: int, load, expert: int = 1, experts: int = 0):
    """Yield ``(name, [{"fp32", "exp_avg", "exp_avg_sq"} tensors of each TP rank])`` of every parameter of a
    ZeRO-1 checkpoint written by ``stages`` x ``data`` x ``tensor`` ranks (names as the writing engine's module
    called them; an MoE model's ``experts`` split over groups of ``expert`` ranks: each expert under its global
    index), its files read with ``load(path)``. DeepSpeed names a rank's files by its model-parallel rank,
    ``stage * tensor + tp_rank``."""
    tag_dir = Path(tag_dir)
    for pp in range(stages):
        per_tp = [_rank_params(tag_dir, pp * tensor + t, data, load, expert, experts) for t in range(tensor)]
        for name in per_tp[0]:
            yield name, [ranks[name] for ranks in per_tp]


def _rank_params(tag_dir: Path, mp: int, data: int, load, expert: int = 1,
                 experts: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """One model-parallel rank's parameters, their slices gathered from the ``data`` ZeRO-1 partitions. Under
    expert parallelism (``expert`` > 1) an expert's group is partitioned over the ranks that hold it: data-parallel
    rank ``dp`` holds experts of expert-parallel rank ``dp % expert`` (DeepSpeed's expert groups are consecutive
    ranks), the ``dp // expert``-th partition of them."""
    shapes = load(tag_dir / model_states_file(mp))["param_shapes"]
    parts: dict[tuple, dict[str, list]] = {}
    for dp in range(data):
        osd = _optim_state(next(tag_dir.glob(f"*zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt")), load)
        for g, mapping in enumerate(osd["param_slice_mappings"]):
            adam = osd["base_optimizer_state"]["state"][g]
            flat = {"fp32": osd["single_partition_of_fp32_groups"][g], "exp_avg": adam["exp_avg"],
                    "exp_avg_sq": adam["exp_avg_sq"]}
            for name, where in mapping.items():
                slot = parts.setdefault((dp % expert if is_expert_weight(name) else 0, name), {k: [] for k in flat})
                for key, tensor in flat.items():
                    slot[key].append(tensor.narrow(0, where.start, where.numel))
    local = experts // expert
    return {ep_global_name(name, r, local) if expert > 1 else name:
            {k: torch.cat(v).reshape(shape).clone() for k, v in parts.pop((r, name)).items()}
            for group in shapes for name, shape in group.items()
            for r in (range(expert) if is_expert_weight(name) else (0,))}


def seed_optimizer_state(optimizer, step: torch.Tensor) -> None:
    """Give a fresh ZeRO-1 / BF16 optimizer Adam state (zero moments at ``step``) and link it to the
    parameters, so ``deepspeed.utils.safe_set_full_optimizer_state`` can write each parameter's moments."""
    flats = getattr(optimizer, "single_partition_of_fp32_groups", None) or optimizer.fp32_groups_flat_partition
    for flat, group in zip(flats, optimizer.optimizer.param_groups):  # AdamW makes its state at the first step
        # where torch's AdamW keeps its step: on the parameter's device when fused or capturable, else on the CPU
        on_device = group.get("fused") or group.get("capturable")
        # a tensor of its own per group: AdamW increments each group's step in place
        where = flat.device if on_device else "cpu"
        optimizer.optimizer.state[flat] = {"step": step.to(where, torch.float32).clone(),
                                           "exp_avg": torch.zeros_like(flat), "exp_avg_sq": torch.zeros_like(flat)}
    optimizer._hp_optimizer_states_linked = False
    optimizer._lazy_init_hp_params_optimizer_state()


# --- expert parallelism: DeepSpeed's expert groups and its MoE engine ------------------------------------------

def expert_parallel_group(size: int, stages: int = 1) -> ExpertParallel:
    """DeepSpeed's expert-parallel groups of ``size`` consecutive ranks and their expert-data-parallel groups (the
    ranks that hold the same experts: every ``size``-th rank), within each of ``stages`` pipeline stages (a stage's
    data-parallel ranks are consecutive: ``parallel.context.topology``), made by every rank before the model is
    built; this rank's expert-parallel group."""
    from deepspeed.utils import groups  # DeepSpeed 0.19.8: utils/groups.py

    name = f"ep_size_{size}"
    groups._create_expert_and_data_parallel(size, mp_size=1, pp_size=stages)
    return ExpertParallel(groups._get_expert_parallel_group(name), size, groups._get_expert_parallel_rank(name), name)


# DeepSpeed 0.19.8 runtime/engine.py: an expert's entry in the MoE checkpoint's files (a key with "expert" must name
# its local index here, else int(None)); saved under the global index (layer_0_expert_<global>_mp_rank_00_...)
_DS_EXPERT = "deepspeed_moe.experts.deepspeed_experts"
EXPERT_STATES_GLOB = "layer_*_expert_*_mp_rank_*_model_states.pt"
_OUR_EXPERT_KEY = re.compile(r"^(.*\.experts)\.(linear_fc[12])\.(?:weight(\d+)|(_extra_state))$")
_DS_EXPERT_KEY = re.compile(
    rf"^\.?(.*\.experts)\.{re.escape(_DS_EXPERT)}\.(\d+)\.(linear_fc[12])\.(weight|_extra_state)$")


def _to_expert_file_key(key: str) -> str:
    """Our key of an expert weight as DeepSpeed's MoE checkpoint names it; a grouped GEMM's one ``_extra_state``
    (its FP8 state) goes with its first expert. Other keys unchanged."""
    if (match := _OUR_EXPERT_KEY.match(key)) is None:
        return key
    experts, gemm, index, extra = match.groups()
    return f"{experts}.{_DS_EXPERT}.{index or 0}.{gemm}.{extra or 'weight'}"


def from_expert_file_key(key: str) -> str:
    """Our key of an entry of DeepSpeed's MoE checkpoint (its expert index ours: the global one in its files);
    other keys unchanged."""
    if (match := _DS_EXPERT_KEY.match(key)) is None:
        return key
    experts, index, gemm, what = match.groups()
    return f"{experts}.{gemm}.{what}{index}" if what == "weight" else f"{experts}.{gemm}.{what}"


def _expert_files_hooks(module: torch.nn.Module) -> None:
    """``module``'s state dict names the experts' weights as DeepSpeed's MoE checkpoint needs them
    (:func:`from_expert_file_key` reads them back), and its loading reads them under those names."""
    def to_files(module, state, prefix, local_metadata):
        for key in [k for k in state if _OUR_EXPERT_KEY.match(k)]:
            state[_to_expert_file_key(key)] = state.pop(key)

    def from_files(module, state, prefix, local_metadata, strict, missing, unexpected, errors):
        for key in [k for k in state if _DS_EXPERT_KEY.match(k)]:
            state[from_expert_file_key(key)] = state.pop(key)

    module.register_state_dict_post_hook(to_files)
    module.register_load_state_dict_pre_hook(from_files)


def _groups_made(self, use_data_before_expert_parallel_=False):
    """MoE's ``set_deepspeed_parallelism``, which the engine calls on each MoE module: :func:`expert_parallel_group`
    made the groups."""


def expert_parallel_module(model: torch.nn.Module, ep: ExpertParallel, num_experts: int) -> torch.nn.Module:
    """``model`` as DeepSpeed's engine takes an MoE model with expert parallelism: a module of
    ``deepspeed.moe.layer.MoE``'s class (the engine's only sign of one; it then reduces the experts' gradients over
    their expert-data-parallel groups, keeps their optimizer state apart and saves one file per expert), whose state
    dict names the experts' weights as DeepSpeed's MoE checkpoint needs them. A pipeline stage's module (the
    engine must see a ``PipelineModule``; ``build.check_stages_hold_experts`` made sure it holds experts) becomes one
    in place: DeepSpeed then saves the stage's model states and its experts' files under the stage's model-parallel
    rank (``mp_rank_<stage>``), each expert-parallel rank its own experts. Any other model is wrapped: a module
    holding ``model``'s own children under their own names, so every parameter keeps its name, and running
    ``model``'s forward; ``model``'s own state dict keeps our names."""
    from deepspeed.moe.layer import MoE
    from deepspeed.pipe import PipelineModule

    marks = {"num_experts": num_experts, "num_local_experts": ep.local(num_experts),
             "expert_group_name": ep.group_name, "ep_size": ep.size}
    if isinstance(model, PipelineModule):
        model.__class__ = type(type(model).__name__, (type(model), MoE), {"set_deepspeed_parallelism": _groups_made})
        model.__dict__.update(marks)
        _expert_files_hooks(model)
        return model

    class ExpertParallelModel(MoE):
        set_deepspeed_parallelism = _groups_made

        def __init__(self):
            torch.nn.Module.__init__(self)  # not MoE's: its gate, experts and dispatch are the model's own
            for name, child in model.named_children():
                self.add_module(name, child)
            self.wrapped = (model,)  # not a child: its children are this module's
            self.__dict__.update(marks)
            _expert_files_hooks(self)

        def forward(self, *args, **kwargs):
            return self.wrapped[0](*args, **kwargs)

        def train(self, mode: bool = True):
            self.wrapped[0].train(mode)
            return super().train(mode)

    return ExpertParallelModel()
