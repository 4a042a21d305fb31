"""Reading checkpoint files that may come from elsewhere: unpickling them executes no code.

``torch.load(weights_only=False)`` runs whatever callable a pickle names, so a checkpoint directory from a
collaborator's bucket or a downloaded run could run code on the machine that reads it (Transformer Engine's
extra-state guard comes too late: the unpickling happens first). Every read outside the live training path
goes through :func:`load_untrusted`: ``weights_only=True`` (tensors and plain containers only) plus an explicit
allowlist of the few DeepSpeed data types its files hold. A file that names anything else is refused with one
line naming the file and the object, before any of it is unpickled.

:func:`vet_files` checks every file of a checkpoint tag the same way, for loaders we do not own (DeepSpeed's
``zero_to_fp32`` reads with ``weights_only=False``): vet the tag first, so nothing unsafe reaches them.
"""

from __future__ import annotations

import importlib
import pickle
import re
import warnings
from pathlib import Path
from typing import NoReturn

import torch

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
    import pickletools
    import zipfile

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


def load_untrusted(path, mmap: bool = False) -> object:
    """``torch.load(path)`` on CPU with ``weights_only=True`` and the allowlist: tensors and plain data only.
    Anything else is a :class:`UserError` naming the file and the object (nothing of the file is executed).
    ``mmap``: map tensor storages instead of reading them (zip checkpoints only)."""
    path = Path(path)
    names = _check(path)
    # import only what the file needs (DeepSpeed's import prints to stderr); a legacy-format file gets none
    allow = [_resolve(n) for n in names or ()]
    try:
        with torch.serialization.safe_globals(allow), warnings.catch_warnings():
            # torch's note on a pickle protocol > 2 (DeepSpeed writes 2): such a file fails below, in one line
            warnings.filterwarnings("ignore", "Detected pickle protocol")
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap and names is not None)
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
