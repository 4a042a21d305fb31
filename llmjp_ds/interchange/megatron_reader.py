"""Reading a Megatron-LM checkpoint directory of either format and any TP/PP/DP layout into whole tensors.

``--load`` is what Megatron-LM's ``--save`` holds (``latest_checkpointed_iteration.txt`` and ``iter_NNNNNNN/``),
or one ``iter_NNNNNNN`` (or ``release``) directory:

* ``torch`` (legacy): ``mp_rank_TT[_PPP]/model_optim_rng.pt`` per tensor-parallel rank TT and pipeline stage PPP
  (a dict: args, iteration, model or model0, model1, ... per virtual-pipeline chunk, optimizer,
  opt_param_scheduler, ...), and ``distrib_optim.pt`` beside it under the distributed optimizer;
* ``torch_dist``: ``metadata.json``, ``.metadata`` and ``__R_K.distcp`` (megatron.core.dist_checkpointing over
  torch.distributed.checkpoint), and the common state (args, iteration, opt_param_scheduler, the optimizer's plain
  part): ``common.pt`` beside them (megatron-core 0.16 and before), or a ``common_state`` item among the DCP items
  (0.19 writes no common.pt).

Every file is read through :mod:`llmjp_ds.checkpoint.safe_load` (nothing in it runs). The result is a
:class:`MegatronCheckpoint`: the weights under Megatron-Core's TE-spec names (``megatron_adapter.canonical_name``),
whole (tensor-parallel shards merged) and numbered globally, and per weight its fp32 master weight and Adam moments
where the checkpoint has them (:mod:`llmjp_ds.interchange.megatron_optim` says where each format keeps them).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from llmjp_ds.checkpoint.safe_load import StandIn, load_megatron
from llmjp_ds.errors import fail
from llmjp_ds.interchange import megatron_adapter as ma
from llmjp_ds.interchange import megatron_moe as moe
from llmjp_ds.interchange import megatron_optim as mo
from llmjp_ds.interchange.dcp_reader import DistCheckpoint
from llmjp_ds.interchange.megatron_dist_optim import dist_optimizer, is_optimizer_key, unstack

TRACKER = "latest_checkpointed_iteration.txt"
_ITER = re.compile(r"^iter_(\d{7})$")
COMMON_FILE, COMMON_OBJECT = "common.pt", "common_state"  # where torch_dist keeps its common state
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(_\d{3})?$")


@dataclass
class MegatronCheckpoint:
    directory: Path  # the iter_ directory
    fmt: str  # torch | torch_dist
    args: dict  # the run's arguments (argparse.Namespace's fields)
    iteration: int
    scheduler: dict  # opt_param_scheduler's state
    weights: dict  # Megatron-Core TE-spec name -> whole tensor
    optimizer: dict | None  # name -> {param, exp_avg, exp_avg_sq}, whole, or None without optimizer state
    step: int  # the optimizer's step count

    def arg(self, name: str, default=None):
        return self.args.get(name, default)


def locate(load, iteration: int | None = None) -> Path:
    """The ``iter_`` directory ``--load`` (and ``--iteration``) name; refused in one line if there is none."""
    load = Path(load)
    if not load.is_dir():
        fail(f"--load {load} is not a directory: pass the directory Megatron-LM saved to (--save), or one of its "
             "iter_NNNNNNN directories")
    if _ITER.match(load.name) or load.name == "release":
        if iteration is not None and load.name != f"iter_{iteration:07d}":
            fail(f"--load {load} is the checkpoint of another iteration than --iteration {iteration}: pass its save "
                 "directory with --iteration, or the iter_ directory alone")
        return load
    iters = sorted(int(m.group(1)) for p in load.iterdir() if (m := _ITER.match(p.name)) and p.is_dir())
    if iteration is None:
        if not (load / TRACKER).is_file():
            fail(f"{load} is not a Megatron-LM checkpoint directory (no {TRACKER}"
                 + (f"; it holds iterations {iters[-3:]}: pass --iteration" if iters else ", no iter_ directories")
                 + ")")
        text = (load / TRACKER).read_text(errors="replace").strip()
        if text == "release":
            return load / "release"
        if not text.isdigit():
            fail(f"{load / TRACKER} holds {text[:40]!r}, not an iteration: pass --iteration N")
        iteration = int(text)
    path = load / f"iter_{iteration:07d}"
    if not path.is_dir():
        fail(f"{load} has no checkpoint of iteration {iteration} ({path.name} is missing); it holds iterations "
             f"{iters[-5:] or 'none'}")
    return path


def read(load, iteration: int | None = None) -> MegatronCheckpoint:
    """The Megatron checkpoint ``--load`` / ``--iteration`` name, read whole."""
    directory = locate(load, iteration)
    if (directory / "metadata.json").is_file():
        return _read_torch_dist(directory)
    if any(_RANK_DIR.match(p.name) for p in directory.iterdir()):
        return _read_torch(directory)
    fail(f"{directory} is not a Megatron checkpoint: it holds neither mp_rank_* directories (format torch) nor "
         "metadata.json (format torch_dist)")


# Megatron-LM arguments that releases name otherwise: megatron-core 0.19's Megatron-LM takes them from
# TransformerConfig's fields (``--norm-epsilon`` sets ``layernorm_epsilon``, ``--apply-layernorm-1p``
# ``layernorm_zero_centered_gamma``), where older ones wrote the flag's own name; some converted checkpoints hold
# ``disable_bias_linear`` instead of ``add_bias_linear`` (megatron-core's own loader inverts it too)
_OLDER_NAMES = {"layernorm_epsilon": ("norm_epsilon", False),
                "layernorm_zero_centered_gamma": ("apply_layernorm_1p", False),
                "add_bias_linear": ("disable_bias_linear", True)}


def _arguments(state, path: Path) -> dict:
    """The run's arguments a checkpoint file holds (an argparse.Namespace, read as a StandIn), as a dict, under
    megatron-core 0.19's names whichever release wrote them (those of :data:`_OLDER_NAMES` filled from their
    older spelling)."""
    args = state.get("args") if isinstance(state, dict) else None
    if not isinstance(args, StandIn):
        fail(f"{path} holds no Megatron-LM arguments: it is not a Megatron-LM checkpoint")
    return current_names(dict(vars(args)))


def current_names(args: dict) -> dict:
    """``args`` with each argument of :data:`_OLDER_NAMES` under its current name where only the older one is
    there (inverted where the older one says the opposite)."""
    out = dict(args)
    for name, (older, inverted) in _OLDER_NAMES.items():
        if out.get(name) is None and out.get(older) is not None:
            out[name] = (not out[older]) if inverted else out[older]
    return out


def check_supported(args, where: Path) -> None:
    """The model Megatron trained is a Llama (RMSNorm, SwiGLU, RoPE, no biases, untied head; qk-layernorm and
    experts as Qwen3-MoE's, :mod:`~llmjp_ds.interchange.megatron_moe`) without context parallelism."""
    wrong = []
    # each argument absent from the releases before it is taken at the value that means "not used"
    checks = (("normalization", "RMSNorm"), ("swiglu", True), ("position_embedding_type", "rope"),
              ("add_bias_linear", False), ("untie_embeddings_and_output_weights", True), ("rotary_interleaved", False),
              ("add_qkv_bias", False), ("layernorm_zero_centered_gamma", False), ("use_rope_scaling", False),
              ("qk_l2_norm", False), ("attention_output_gate", False), ("multi_latent_attention", False),
              ("squared_relu", False), ("use_mup", False), ("softmax_type", "vanilla"))
    for name, want in checks:
        have = args.get(name, want)
        if have != want:
            wrong.append(f"{name}={have!r}")
    if args.get("rope_type") not in (None, "rope"):
        wrong.append(f"rope_type={args.get('rope_type')!r}")
    for name in ("rampup_batch_size", "no_rope_freq", "window_size", "mtp_num_layers",
                 "rotary_seq_len_interpolation_factor", "experimental_attention_variant", "hybrid_layer_pattern",
                 "heterogeneous_layers_config_path"):
        if args.get(name):
            wrong.append(f"{name}={args.get(name)!r}")
    for name in ("context_parallel_size", "num_distributed_optimizer_instances"):
        if mo.arg_int(args, name) != 1:
            wrong.append(f"{name}={args.get(name)!r}")
    if float(args.get("rotary_percent", 1.0) or 1.0) != 1.0:
        wrong.append(f"rotary_percent={args.get('rotary_percent')!r}")
    wrong += moe.unsupported(args)
    if wrong:
        fail(f"{where} was trained with {', '.join(wrong)}: llmjp-ds continues Llama-style runs only (RMSNorm, "
             "SwiGLU, full unscaled RoPE, full attention, no biases, untied head, no MTP, context parallelism or "
             "batch ramp-up; MoE as Qwen3-MoE: a softmax over the top-k router logits, no shared experts, no expert "
             "bias)")


# --- torch (legacy) ---------------------------------------------------------------------------------------------

def _rank_dirs(directory: Path, tp: int, pp: int, ep: int) -> dict[tuple[int, int, int], Path]:
    """The rank directories of a legacy checkpoint by (tensor, pipeline, expert) rank: ``mp_rank_TT``, with
    ``_PPP`` under pipeline parallelism and ``_EEE`` under expert parallelism (so ``mp_rank_00_001`` is a pipeline
    stage or an expert rank: the run's arguments say which)."""
    layout = f"TP {tp} x PP {pp}" + (f" x EP {ep}" if ep > 1 else "")
    found = {}
    for p in directory.iterdir():
        m = _RANK_DIR.match(p.name)
        if m and p.is_dir():
            ranks = [int(g.lstrip("_")) for g in m.groups()[1:] if g is not None]
            if len(ranks) != (pp > 1) + (ep > 1):
                fail(f"{directory} holds {p.name}, which does not add up to the {layout} its arguments give: the "
                     "directory mixes checkpoints of several layouts; import it from a copy of one run's files")
            stage, expert = (ranks.pop(0) if pp > 1 else 0), (ranks.pop(0) if ep > 1 else 0)
            found[(int(m.group(1)), stage, expert)] = p
    want = {(t, s, e) for t in range(tp) for s in range(pp) for e in range(ep)}

    def name(t, s, e):
        return f"mp_rank_{t:02d}" + (f"_{s:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")
    missing = sorted(want - set(found))
    if missing:
        fail(f"{directory} lacks {name(*missing[0])}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
             + f": its arguments say {layout}; the checkpoint is incomplete, copy every mp_rank directory")
    extra = [found[k].name for k in sorted(set(found) - want)]
    if extra:
        fail(f"{directory} holds {extra[0]}, which does not add up to the {layout} its arguments give: the "
             "directory mixes checkpoints of several layouts; import it from a copy of one run's files")
    return found


def _flatten(tree, prefix: str = "") -> dict:
    """A legacy Megatron-LM model state (nested dicts) as one level of dotted names."""
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    out = {}
    for key, value in tree.items():
        out.update(_flatten(value, f"{prefix}{key}."))
    return out


def _model_chunks(state: dict, path: Path) -> list[dict]:
    if "model" in state:
        return [_flatten(state["model"])]
    keys = sorted((k for k in state if re.fullmatch(r"model\d+", str(k))), key=lambda k: int(k[5:]))
    chunks = [state[k] for k in keys]
    if not chunks:
        fail(f"{path} holds no model (no 'model' entry): it is not a Megatron model checkpoint")
    return [_flatten(c) for c in chunks]


def _legacy_layout(args, directory: Path) -> tuple[int, int, int, int]:
    """(TP, PP, EP, experts per expert-parallel rank) of a legacy checkpoint; Megatron-LM writes its expert files
    by tensor-parallel rank, so an expert split over another tensor-parallel size cannot be found in them."""
    tp, pp = mo.arg_int(args, "tensor_model_parallel_size"), mo.arg_int(args, "pipeline_model_parallel_size")
    ep, etp, _ = moe.expert_layout(args)
    if moe.num_experts(args) and etp != tp:
        fail(f"{directory} was saved in the torch format with expert_tensor_parallel_size={etp} and "
             f"tensor_model_parallel_size={tp}: Megatron-LM's legacy files hold the experts by tensor-parallel rank "
             "only when the two agree; save the run as torch_dist (--ckpt-format torch_dist) and import that")
    return tp, pp, ep, moe.num_experts(args) // ep


def _read_torch(directory: Path) -> MegatronCheckpoint:
    first = next(p for p in sorted(directory.iterdir()) if _RANK_DIR.match(p.name))
    head = load_megatron(_model_file(first))
    args = _arguments(head, _model_file(first))
    check_supported(args, directory)
    if float(head.get("checkpoint_version") or 0) < 2.0:  # Megatron-LM's fix_query_key_value_ordering
        fail(f"{directory} is a Megatron-LM checkpoint of version {head.get('checkpoint_version')}, whose fused QKV "
             "is ordered otherwise (before 2.0): load and save it once with a recent Megatron-LM first")
    tp, pp, ep, local = _legacy_layout(args, directory)
    dirs = _rank_dirs(directory, tp, pp, ep)
    states = {key: (head if path == first else load_megatron(_model_file(path))) for key, path in dirs.items()}
    chunks = {key: _model_chunks(s, dirs[key]) for key, s in states.items()}
    vp = len(chunks[(0, 0, 0)])
    counts = [[ma.layer_count(chunks[(0, s, 0)][v]) for s in range(pp)] for v in range(vp)]
    offsets = ma.chunk_layer_offsets(counts)
    weights = {}
    for s in range(pp):
        for v in range(vp):
            for e in range(ep):
                ranks = [chunks[(t, s, e)][v] for t in range(tp)]
                if e:  # the other expert ranks' files: their experts; the rest is the first's, which they repeat
                    _check_replicas(ranks, [chunks[(t, s, 0)][v] for t in range(tp)], dirs[(0, s, e)])
                merged = _merge_tp(ranks, (lambda n: ma.is_expert(n)) if e else None)
                weights.update(ma.renumber_layers(ma.globalize_experts(merged, e * local), offsets[v][s]))
    optimizer, step = _torch_optimizer(directory, args, dirs, states, chunks, offsets)
    return MegatronCheckpoint(directory, "torch", args, int(head.get("iteration", 0)),
                              dict(head.get("opt_param_scheduler") or {}), ma.canonical_state(weights), optimizer,
                              step)


def _check_replicas(ranks: list[dict], firsts: list[dict], where: Path) -> None:
    """The dense weights of an expert-parallel rank's files are those of expert rank 0's (Megatron replicates them
    over the expert-parallel group)."""
    for shard, first in zip(ranks, firsts):
        for name, tensor in shard.items():
            if ma.is_extra_state(name) or ma.is_expert(name) or not hasattr(tensor, "dtype"):
                continue
            if name not in first or not torch.equal(tensor, first[name]):
                fail(f"{where}'s {name} differs from the first expert-parallel rank's: the directory mixes the files "
                     "of several runs or iterations; import it from a copy of one checkpoint's files")


def _model_file(rank_dir: Path) -> Path:
    path = rank_dir / "model_optim_rng.pt"
    if not path.is_file():
        fail(f"{rank_dir} lacks model_optim_rng.pt: the checkpoint is incomplete; copy it again from the Megatron run")
    return path


def _merge_tp(shards: list[dict], keep=None) -> dict:
    return {name: ma.tp_merge_megatron(name, [s[name] for s in shards]) for name in shards[0]
            if not ma.is_extra_state(name) and (keep is None or keep(name))}


def _params(chunk: dict, experts: bool | None = None) -> list[tuple[str, int, torch.dtype]]:
    """(name, numel, dtype) of a chunk's parameters in registration order: all of them, or (``experts``) the
    experts' alone or the others alone (Megatron's DDP keeps the two in buffers of their own)."""
    return [(n, t.numel(), t.dtype) for n, t in chunk.items() if not ma.is_extra_state(n) and hasattr(t, "dtype")
            and (experts is None or ma.is_expert(n) == experts)]


def _torch_optimizer(directory, args, dirs, states, chunks, offsets):
    """(name -> whole {param, exp_avg, exp_avg_sq}, step) of a legacy checkpoint; (None, 0) without optimizer."""
    head = states[(0, 0, 0)]
    if "optimizer" not in head:
        return None, 0
    tp, _, _, local = _legacy_layout(args, directory)
    per_rank = {}
    for (t, s, e), path in dirs.items():
        if args.get("use_distributed_optimizer", False):
            per_rank[(t, s, e)] = _distributed_states(path, args, chunks[(t, s, e)], s, e)
        elif moe.num_experts(args):
            fail(f"{directory} holds an MoE run's optimizer of Megatron's non-distributed kind in the torch format, "
                 "which is not read: save the run as torch_dist (--ckpt-format torch_dist) and import that")
        else:
            per_rank[(t, s, e)] = _local_state(path, states[(t, s, e)].get("optimizer") or {}, chunks[(t, s, e)])
    merged = {}
    for (t, s, e), state in per_rank.items():
        if t:
            continue
        for v, names in enumerate(state):
            for name in names:
                whole = {k: ma.tp_merge_megatron(name, [per_rank[(r, s, e)][v][name][k] for r in range(tp)])
                         for k in mo.STATES}
                merged.update(ma.renumber_layers(ma.globalize_experts({name: whole}, e * local), offsets[v][s]))
    opts = head["optimizer"] if isinstance(head["optimizer"], list) else [head["optimizer"]]  # one per chained
    steps = []
    for opt in opts:
        inner = (opt.get("optimizer") or {}) if isinstance(opt, dict) else {}
        steps += [g.get("step") for g in inner.get("param_groups", [])]
        steps += [s.get("step") for s in inner.get("state", {}).values() if isinstance(s, dict)]
    step = mo.optimizer_step([float(x) for x in steps if x is not None], directory / "mp_rank_00")
    return ma.canonical_state(merged), step


def _distributed_states(rank_dir: Path, args, chunks: list[dict], stage: int, expert_rank: int) -> list[dict]:
    """Per model chunk: name (local) -> {param, exp_avg, exp_avg_sq} shaped as the rank's weight, from the rank's
    ``distrib_optim.pt``: one optimizer's state, or (an MoE model's experts kept apart,
    :func:`~llmjp_ds.interchange.megatron_moe.optimizer_counts`: megatron-core's ChainedOptimizer) a list of the
    dense parameters' (on expert rank 0; the others repeat them, and store None) and the experts'."""
    path = rank_dir / "distrib_optim.pt"
    if not path.is_file():
        fail(f"{rank_dir} lacks distrib_optim.pt, which the distributed optimizer writes beside model_optim_rng.pt: "
             "the checkpoint is incomplete; copy it again from the Megatron run")
    state = load_megatron(path)
    parts = state if isinstance(state, list) else [state]
    counts = moe.optimizer_counts(args)
    apart = len(parts) == 2
    if len(parts) not in counts or (parts[0] is None) != (expert_rank > 0) or (apart and parts[1] is None):
        fail(f"{path} holds {len(parts)} optimizer states ({', '.join('none' if p is None else 'one' for p in parts)})"
             f" where Megatron writes {' or '.join(map(str, counts))} for its arguments (two: the dense parameters and"
             " the experts apart): it does not match its model (another megatron-core layout)")
    numel = sum(n for c in chunks for _, n, _ in _params(c))
    out: list[dict] = [{} for _ in chunks]
    ep, _, edp = moe.expert_layout(args)
    groups = [(parts[0], False, mo.arg_int(args, "data_parallel_size"))] + ([(parts[1], True, edp)] if apart else [])
    for part, of_experts, dp in groups:
        if part is None:
            continue
        params = [_params(c, of_experts if apart else None) for c in chunks]
        for v, found in enumerate(_buffer_states(part, params, args, stage, numel, dp, path)):
            out[v].update({name: {k: t.view(chunks[v][name].shape) for k, t in tensors.items()}
                           for name, tensors in found.items()})
    return out


def _buffer_states(state: dict, chunks: list[list], args, stage: int, numel: int, dp: int, path: Path) -> list[dict]:
    """Per model chunk: name -> flat {param, exp_avg, exp_avg_sq} of one optimizer's ``save_parameter_state``
    (``chunks``: each chunk's parameters of that optimizer, (name, numel, dtype) in registration order)."""
    out: list[dict] = [{} for _ in chunks]
    for index, (v, dtype, params) in enumerate(mo.buffers_of(chunks)):
        stored = state.get(index) if isinstance(state, dict) else None
        world = next((w for key, w in (stored or {}).items() if isinstance(key, tuple) and key[0] == dtype), None)
        if world is None:
            fail(f"{path} holds no optimizer state for buffer {index} ({dtype}): it does not match its model")
        buckets = mo.buffer_layout(params, mo.bucket_size(args, v, stage, numel), dp,
                                   bool(args.get("ddp_pad_buckets_for_high_nccl_busbw", False)))
        if state.get("buckets_coalesced"):
            out[v].update(mo.split_buffer(world, buckets, str(path)))
        else:
            out[v].update(mo.split_buckets(world, buckets, str(path)))
    return out


def _local_state(rank_dir: Path, opt: dict, chunks: list[dict]) -> list[dict]:
    """The same from Megatron's non-distributed optimizer (Float16OptimizerWithFloat16Params or FP32Optimizer):
    its groups list the parameters by index, in group order."""
    where = rank_dir / "model_optim_rng.pt"
    inner = opt.get("optimizer", opt) if isinstance(opt, dict) else {}
    groups, state = inner.get("param_groups", []), inner.get("state", {})
    names = [(f"{v}:{n}", chunks[v][n].dim()) for v, c in enumerate(chunks) for n, _, _ in _params(c)]
    members = mo.group_members(names, groups, str(where))
    masters = opt.get("fp32_from_fp16_params")
    out: list[dict] = [{} for _ in chunks]
    for g, (group, member) in enumerate(zip(groups, members)):
        for i, (index, key) in enumerate(zip(group["params"], member)):
            v, name = key.split(":", 1)
            weight = chunks[int(v)][name]
            moments = state.get(index, {})
            master = masters[g][i] if masters else weight
            if tuple(master.shape) != tuple(weight.shape):
                fail(f"{where}: the optimizer's parameter {index} has shape {list(master.shape)}, its weight "
                     f"{name} {list(weight.shape)}: the optimizer groups differ from Megatron's defaults")
            zeros = torch.zeros(weight.shape)
            out[int(v)][name] = {"param": master.float(), "exp_avg": moments.get("exp_avg", zeros).float(),
                                 "exp_avg_sq": moments.get("exp_avg_sq", zeros).float()}
    return out


# --- torch_dist ---------------------------------------------------------------------------------------------------

def _read_torch_dist(directory: Path) -> MegatronCheckpoint:
    try:
        backend = json.loads((directory / "metadata.json").read_text()).get("sharded_backend")
    except (OSError, ValueError, AttributeError) as exc:
        fail(f"{directory / 'metadata.json'} cannot be read ({exc}): the checkpoint is damaged")
    if backend != "torch_dist":
        fail(f"{directory} is a Megatron distributed checkpoint of backend {backend!r}: only torch_dist is supported")
    dcp = DistCheckpoint(directory)
    common, where = _common_state(dcp)
    args = _arguments(common, where)
    check_supported(args, directory)
    weights = _dist_weights(dcp, mo.arg_int(args, "num_layers", 0))
    optimizer, step = dist_optimizer(dcp, common, args, weights)
    return MegatronCheckpoint(directory, "torch_dist", args, int(common.get("iteration", 0)),
                              dict(common.get("opt_param_scheduler") or {}), weights, optimizer, step)


def _common_state(dcp) -> tuple[dict, Path]:
    """The checkpoint's common state (args, iteration, opt_param_scheduler, the optimizer's plain part) and where it
    was read: ``common.pt`` where there is one (megatron-core 0.16 and before), else the ``common_state`` item of
    the distributed checkpoint (0.19), in the order megatron-core 0.19's ``load_common_state_dict`` looks."""
    if (dcp.dir / COMMON_FILE).is_file():
        return load_megatron(dcp.dir / COMMON_FILE), dcp.dir / COMMON_FILE
    common = dcp.object(COMMON_OBJECT)
    if common is None:
        fail(f"{dcp.dir} holds neither {COMMON_FILE} (megatron-core 0.16 and before) nor a {COMMON_OBJECT!r} item "
             "(0.19): its common state (args, iteration, LR schedule) is missing; copy the checkpoint again from "
             "the Megatron run")
    return common, dcp.dir / f"{COMMON_OBJECT} (in .metadata)"


def _dist_weights(dcp, num_layers: int) -> dict:
    weights = {}
    for key in dcp.tensor_keys():
        if is_optimizer_key(key) or ma.is_extra_state(key):
            continue
        weights.update(unstack(key, dcp.tensor(key), num_layers))
    return ma.canonical_state(weights)
