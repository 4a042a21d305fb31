"""Reading checkpoint files: unpickling them executes no code, whether they come from elsewhere or from the run.

``torch.load(weights_only=False)`` runs whatever callable a pickle names, so a checkpoint directory from a
collaborator's bucket or a downloaded run could run code on the machine that reads it (Transformer Engine's
extra-state guard comes too late: the unpickling happens first). Every read outside the live training path
goes through :func:`load_untrusted`: ``weights_only=True`` (tensors and plain containers only) plus an explicit
allowlist of the few DeepSpeed data types its files hold. A file that names anything else is refused with one
line naming the file and the object, before any of it is unpickled.

:func:`vet_files` checks every file of a checkpoint tag the same way, for loaders we do not own (DeepSpeed's
``zero_to_fp32`` reads with ``weights_only=False``): vet the tag first, so nothing unsafe reaches them.

A run's own directory is no safer than a download (anyone who can write a file there can plant one), so resume
reads through here too: DeepSpeed's engine is handed :func:`load_checkpoint_file` as its reader. Transformer
Engine's ``_extra_state`` is a pickle inside a uint8 tensor, unpickled by TE itself when the module loads it;
:func:`vet_extra_state` first unpickles it with an allowlist of its own (TE's recipe classes, CPU tensors whose
storages are read with ``weights_only=True``), so what TE then unpickles names nothing else.
"""

from __future__ import annotations

import importlib
import io
import pickle
import pickletools
import re
import warnings
import zipfile
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed.checkpoint.filesystem as dcp_fs
import torch.distributed.checkpoint.metadata as dcp_md

from llmjp_ds.errors import fail

# The globals DeepSpeed 0.19.8 pickles into a checkpoint beyond torch's own weights_only defaults (tensors,
# dict/OrderedDict/list/tuple/set, numbers, strings, torch.Size, dtypes): listed by
# torch.serialization.get_unsafe_globals_in_checkpoint over real CPU checkpoints of every layout (1 process,
# ZeRO-0/1/2/3, pipeline=2; fp32 and bf16; after an emulated FP8 flip). The model-states files (mp_rank_*,
# zero_pp_rank_*_model_states, layer_*) need none of them: `module` (with the `_extra_state` tensors),
# `param_shapes`, `ds_config`, our train state and the RNG state are tensors, torch.Size and plain containers.
# Only the optimizer-states files hold these, each plain data restored by __new__ + attribute update (or an
# int Enum lookup), no callable with effects:
ALLOWED_GLOBALS = (
    # optimizer_state_dict["loss_scaler"] of the ZeRO-1/2/3 optimizers of fp32 runs and of bf16 ZeRO-3: the
    # static scaler's numbers (cur_scale, dynamic=False, ...)
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    # optimizer_state_dict["zero_stage"] of the same optimizers: an int Enum (zero_to_fp32 reads it)
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    # optimizer_state_dict["param_slice_mappings"] of ZeRO-1/2 and of the bf16 optimizer (bf16 ZeRO-1, pipeline):
    # a dataclass of two ints (numel, start)
    "deepspeed.utils.tensor_fragment.fragment_address",
)
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_DETAIL = re.compile(r"WeightsUnpickler error:\s*(.+?)\s*(?:\n\n|$)", re.DOTALL)


def _refuse(path: Path, name: str) -> NoReturn:
    fail(f"{path} holds {name}, which loading would have to execute: refusing to read it (llmjp-ds reads "
         "checkpoints with weights_only=True); re-save it from a trusted run")


def _globals_of(path: Path) -> list[str] | None:
    """The globals the file's pickle names beyond torch's weights_only defaults, read without unpickling
    anything; None where the file is not a zip checkpoint (legacy format) or the scan cannot parse it."""
    try:
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except (ValueError, pickle.UnpicklingError, RuntimeError, EOFError):
        return None


def _named_in_pickle(path: Path) -> list[str]:
    """Best effort, nothing executed: the globals (GLOBAL, STACK_GLOBAL) a zip checkpoint's pickle of any
    protocol names, for a file torch's scan cannot parse (pickle protocol 4+); [] where unknown."""
    try:
        with zipfile.ZipFile(path) as z:
            data = z.read(next(n for n in z.namelist() if n.rsplit("/", 1)[-1] == "data.pkl"))
        names, pushed, memo = [], [], {}
        for op, arg, _ in pickletools.genops(data):
            if op.name == "GLOBAL":
                names.append(arg.replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(pushed) > 1 and None not in pushed[-2:]:
                names.append(f"{pushed[-2]}.{pushed[-1]}")
            if op.name == "MEMOIZE":
                memo[len(memo)] = pushed[-1] if pushed else None
            elif op.name in ("BINPUT", "LONG_BINPUT", "PUT"):
                memo[arg] = pushed[-1] if pushed else None
            else:
                pushed.append(memo.get(arg) if op.name.endswith("GET") else arg if isinstance(arg, str) else None)
        # torch's own defaults, to leave them out of the message (a private function: best effort)
        from torch._weights_only_unpickler import _get_allowed_globals

        safe = {*_get_allowed_globals(), *ALLOWED_GLOBALS}
        return [n for n in dict.fromkeys(names) if n not in safe]
    except Exception:  # noqa: BLE001 -- only a better message is at stake; the refusal stands either way
        return []


def _check(path: Path) -> list[str] | None:
    """Refuse the file if it names a global outside the allowlist; else the allowlisted names it needs."""
    names = _globals_of(path)
    bad = [n for n in names or () if n not in ALLOWED_GLOBALS]
    if bad:
        _refuse(path, ", ".join(bad))
    return names


def _resolve(name: str):
    module, attr = name.rsplit(".", 1)
    return getattr(importlib.import_module(module), attr)


def load_untrusted(path, mmap: bool = False, map_location="cpu") -> object:
    """``torch.load(path)`` with ``weights_only=True`` and the allowlist: tensors and plain data only (on CPU
    unless ``map_location`` says otherwise). Anything else is a :class:`UserError` naming the file and the object
    (nothing of the file is executed). ``mmap``: map tensor storages instead of reading them (zip checkpoints
    only)."""
    path = Path(path)
    names = _check(path)
    # import only what the file needs (DeepSpeed's import prints to stderr); a legacy-format file gets none
    allow = [_resolve(n) for n in names or ()]
    try:
        with torch.serialization.safe_globals(allow), warnings.catch_warnings():
            # torch's note on a pickle protocol > 2 (DeepSpeed writes 2): such a file fails below, in one line
            warnings.filterwarnings("ignore", "Detected pickle protocol")
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap and names is not None)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        found = _GLOBAL.search(text)
        named = [found.group(1)] if found else _named_in_pickle(path)
        if named:
            _refuse(path, ", ".join(named))
        detail = _DETAIL.search(text)
        fail(f"{path} cannot be read with weights_only=True ({detail.group(1) if detail else 'unsupported pickle'}):"
             " refusing to unpickle it, as that could execute code; re-save it from a trusted run")


def vet_files(directory, pattern: str = "*.pt") -> list[Path]:
    """Load every ``pattern`` file of ``directory`` with :func:`load_untrusted` (tensor data mapped, not read)
    and return them, so a loader that trusts its input can read them next. All files' globals are checked
    before any is loaded: a refusal costs no tensor I/O and imports nothing."""
    files = sorted(Path(directory).glob(pattern))
    for f in files:
        _check(f)
    for f in files:
        load_untrusted(f, mmap=True)
    return files


# --- Transformer Engine's pickled extra state ----------------------------------------------------------------

# TE 2.x pickles {recipe, scale/amax tensors, plain values} with pickle.dumps: a recipe is a dataclass or enum
# of this module, and a CPU tensor pickles as _rebuild_tensor_v2 over a storage that torch.storage._load_from_bytes
# reads with torch.load (read here with weights_only=True instead)
TE_RECIPE_MODULE = "transformer_engine.common.recipe"
EXTRA_STATE_GLOBALS = {("torch._utils", "_rebuild_tensor_v2"), ("collections", "OrderedDict"),
                       ("torch.storage", "_load_from_bytes")}


class _RecipeStandIn:
    """What a TE recipe class unpickles to while vetting on a machine without TE: accepts any state."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass


def _safe_storage(data: bytes):
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


class _ExtraStateUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _safe_storage
        if (module, name) in EXTRA_STATE_GLOBALS:
            return super().find_class(module, name)
        if module == TE_RECIPE_MODULE:
            try:
                found = getattr(importlib.import_module(module), name)
            except ImportError:  # no TE here: nothing will unpickle it for real, the names are what matter
                return _RecipeStandIn
            if isinstance(found, type):  # a recipe dataclass or enum, never a function
                return found
        raise pickle.UnpicklingError(f"{module}.{name}")


def vet_extra_state(path, name: str, value) -> None:
    """Refuse ``value`` (the ``name`` entry of a state dict read from ``path``) if it is TE's pickled extra state
    and names anything beyond :data:`EXTRA_STATE_GLOBALS` and TE's recipe classes. Nothing but those runs."""
    if not (isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.numel()):
        return
    try:
        _ExtraStateUnpickler(io.BytesIO(value.numpy().tobytes())).load()
    except pickle.UnpicklingError as exc:
        detail = str(exc)
        _refuse(Path(path), f"{detail} in {name}" if re.fullmatch(r"[\w.]+", detail) else
                f"an unreadable pickle in {name} ({detail})")
    except Exception as exc:  # noqa: BLE001 -- any other failure: a pickle we cannot vet is not loaded
        _refuse(Path(path), f"an unreadable pickle in {name} ({type(exc).__name__})")


def vet_extra_states(path, state) -> None:
    """:func:`vet_extra_state` on every ``*_extra_state`` entry of ``state`` (nested dicts included)."""
    if isinstance(state, dict):
        for key, value in state.items():
            if isinstance(key, str) and key.endswith("_extra_state"):
                vet_extra_state(path, key, value)
            elif isinstance(value, dict):
                vet_extra_states(path, value)


def load_checkpoint_file(path, map_location="cpu") -> object:
    """DeepSpeed's checkpoint reader, ours: :func:`load_untrusted` plus :func:`vet_extra_states`. A planted file
    is a :class:`UserError` naming it and what it holds; nothing of it runs."""
    state = load_untrusted(path, map_location=map_location)
    vet_extra_states(path, state)
    return state


# --- Megatron-LM's checkpoints --------------------------------------------------------------------------------

class StandIn:
    """What an object of Megatron's pickles becomes here: inert data. Its constructor arguments are kept as
    ``args`` (an enum's value, a path's parts), a dict state becomes its attributes (an ``argparse.Namespace``'s
    fields), any other state is kept as ``state``. No code of the class it stands for runs, or is even imported."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state


def _stand_in(name: str) -> type:
    return type(name.rsplit(".", 1)[1], (StandIn,), {"__module__": "llmjp_ds.checkpoint.safe_load.megatron",
                                                    "__qualname__": name})


# The globals Megatron-LM (megatron-core 0.14-0.19, megatron/training) pickles into checkpoint files beyond torch's
# weights_only defaults, as megatron-core's own safe_globals.py lists them and as seen in files it wrote: the run's
# arguments (argparse.Namespace, with enums, a Path, a signal), the RNG states (numpy's arrays), the rerun state
# machine's enums, and TE's extra state of old releases (io.BytesIO). Each is read as a StandIn: nothing of it runs.
MEGATRON_GLOBALS = tuple((_stand_in(name), name) for name in (
    "argparse.Namespace", "types.SimpleNamespace", "pathlib.PosixPath", "signal.Signals", "io.BytesIO",
    "numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype",
    "numpy.dtypes.UInt32DType", "torch._C.Generator", "megatron.core.enums.ModelType",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig", "megatron.core.optimizer.OptimizerConfig",
    "megatron.core.rerun_state_machine.RerunDiagnostic", "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState", "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.AttnMaskType", "megatron.core.transformer.enums.CudaGraphModule",
    "megatron.core.transformer.enums.CudaGraphScope", "megatron.core.transformer.enums.InferenceCudaGraphScope"))


def load_megatron(source, where: str | None = None) -> object:
    """A torch.save file of Megatron-LM (a path, or the bytes of an item of a distributed checkpoint, named
    ``where``), read with ``weights_only=True`` and :data:`MEGATRON_GLOBALS` as stand-ins: tensors, plain data and
    :class:`StandIn` objects. Anything else is refused in one line naming the file and the object; a file that is
    not a torch checkpoint (cut short, damaged) too."""
    path = Path(where or source)
    stream = io.BytesIO(source) if isinstance(source, bytes) else source
    # only these stand-ins: what else the process put on torch's allowlist (megatron-core registers the real
    # classes of these names when it is imported) would be taken first
    registered = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        with torch.serialization.safe_globals(list(MEGATRON_GLOBALS)), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Detected pickle protocol")
            return torch.load(stream, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = _GLOBAL.search(str(exc))
        if found:
            _refuse(path, found.group(1))
        detail = _DETAIL.search(str(exc))
        fail(f"{path} cannot be read with weights_only=True ({detail.group(1) if detail else 'unsupported pickle'}):"
             " refusing to unpickle it, as that could execute code")
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        fail(f"{path} is not a readable torch checkpoint file ({reason}): it is damaged or cut short; copy it "
             "again from the Megatron run")
    finally:
        torch.serialization.add_safe_globals(registered)


def _storage_layout(name: str):
    """torch.serialization._get_layout, for the one layout a checkpoint's tensors have."""
    if name != "torch.strided":
        raise pickle.UnpicklingError(f"torch.serialization._get_layout({name!r})")
    return torch.strided


def _dcp_classes() -> dict:
    classes = {f"torch.distributed.checkpoint.metadata.{n}": getattr(dcp_md, n) for n in (
        "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties", "BytesStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")}
    classes["torch.distributed.checkpoint.filesystem._StorageInfo"] = dcp_fs._StorageInfo
    # the savers' plans, kept in the metadata: not needed to read it back
    for n in ("SavePlan", "WriteItem", "TensorWriteData", "WriteItemType", "BytesIOWriteData"):
        classes[f"torch.distributed.checkpoint.planner.{n}"] = _stand_in(f"torch.distributed.checkpoint.planner.{n}")
    classes["torch.serialization._get_layout"] = _storage_layout
    classes["torch.Size"] = torch.Size
    classes["collections.OrderedDict"] = __import__("collections").OrderedDict
    return classes


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, allowed: dict):
        super().__init__(file)
        self.allowed = allowed

    def find_class(self, module, name):
        full = f"{module}.{name}"
        if full in self.allowed:
            return self.allowed[full]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(full)


def load_dcp_metadata(path) -> object:
    """The ``.metadata`` of a torch.distributed.checkpoint directory (a plain pickle, which DCP itself reads with
    ``pickle.load``), unpickled with an allowlist: DCP's metadata data classes, sizes and dtypes. Anything else
    is refused in one line."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f, _dcp_classes()).load()
    except pickle.UnpicklingError as exc:
        detail = str(exc)
        if re.fullmatch(r"[\w.]+", detail):
            _refuse(path, detail)
        fail(f"{path} is not a readable checkpoint metadata file ({detail[:160]}): it is damaged or cut short")
    except (EOFError, OSError, ValueError, TypeError, AttributeError, IndexError) as exc:
        fail(f"{path} is not a readable checkpoint metadata file ({type(exc).__name__}: {str(exc)[:120]}): it is "
             "damaged or cut short; copy it again from the Megatron run")
