"""Every use of megatron-core that is not its public dataset API, in one place, with the versions it was read from.

``data.order: megatron`` (:mod:`llmjp_ds.data.megatron_order`) calls megatron-core's own dataset code rather than
a copy of it. Read from megatron-core 0.16.1 (Python 3.11) and 0.19.2 (Python 3.12), ``megatron/core/datasets/``:
``gpt_dataset.py``, ``blended_dataset.py``, ``blended_megatron_dataset_builder.py``, ``helpers.cpp``, ``utils.py``.
The builder, ``helpers.cpp`` and ``utils.py`` are the same in both; the other two differ only in what does not make
the windows (0.19 loads cached indices through ``safe_numpy_load`` and returns the documents' lengths too).

* ``GPTDataset._query_document_sample_shuffle_indices(j)`` is the raw window of mid-level sample ``j``:
  ``seq_len + 1`` token ids, before any mask, label shift or padding (``__getitem__`` builds those from it). It
  returns a tuple whose first item is the window (0.16: text and document ids; 0.19 adds the documents' lengths).
* ``megatron.core.safe_globals.SAFE_GLOBALS``: the classes megatron.core's import adds to torch's ``weights_only``
  allowlist, and (0.19) its ``safe_load_from_bytes`` put in place of ``torch.storage._load_from_bytes``
  (:func:`datasets` takes both back).
* ``BlendedDataset.dataset_index[i]`` / ``dataset_sample_index[i]``: which of ``BlendedDataset.datasets``, and
  which of its samples, blended sample ``i`` is (``BlendedDataset.__getitem__`` reads the same two arrays).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
import types
import warnings

import numpy as np

READ_FROM = ("0.16.1", "0.19.2")
MIN_VERSION = (0, 16)
FIX = "pip install 'llmjp-ds[megatron]', or set data.order=llmjp"


def megatron_core_problem() -> str | None:
    """Why megatron-core's dataset code cannot serve ``data.order: megatron`` here (one clause), or None. Finds
    the package without importing it (megatron.core's import takes seconds)."""
    try:
        found = importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError) as exc:
        found, why = False, str(exc)
    else:
        why = "No module named 'megatron.core'"
    if not found:
        return f"megatron-core is not importable ({why})"
    try:
        version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None  # a source checkout on the path: its code is what it is
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if parts < MIN_VERSION:
        return (f"megatron-core {version} is older than {'.'.join(map(str, MIN_VERSION))}, the first version its "
                f"dataset code was checked against")
    return None


def version() -> str:
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def datasets() -> types.SimpleNamespace:
    """megatron-core's dataset modules (``builder``, ``gpt``, ``config``), imported quietly: megatron.core warns at
    import about Transformer Engine and Apex, which its dataset code does not use. Its import also puts its own
    classes on torch's global ``weights_only`` allowlist and (0.19) replaces torch's ``_load_from_bytes``, the
    function every pickled CPU tensor names, TE's FP8 extra state included (``megatron/core/safe_globals.py``). Both
    are undone: a run under this order loads checkpoints with the project's allowlist alone
    (``checkpoint/safe_load.py``), and the checkpoints it writes name torch's function, not megatron-core's."""
    import torch.serialization
    import torch.storage

    load_from_bytes = torch.storage._load_from_bytes
    names = {"builder": "blended_megatron_dataset_builder", "gpt": "gpt_dataset",
             "config": "blended_megatron_dataset_config"}
    allowed = torch.serialization.get_safe_globals()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return types.SimpleNamespace(**{k: importlib.import_module(f"megatron.core.datasets.{m}")
                                            for k, m in names.items()})
    finally:  # keep what was there and what torch's own modules registered meanwhile; drop megatron-core's list
        torch.storage._load_from_bytes = load_from_bytes
        megatrons = getattr(sys.modules.get("megatron.core.safe_globals"), "SAFE_GLOBALS", [])
        keep = [g for g in torch.serialization.get_safe_globals() if g in allowed or g not in megatrons]
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(keep)


def window(mid_level, j: int) -> np.ndarray:
    """The ``seq_len + 1`` token ids of sample ``j`` of a GPTDataset, as int64."""
    return np.asarray(mid_level._query_document_sample_shuffle_indices(int(j))[0], dtype=np.int64)


def sample_source(top, i: int) -> tuple[int, object, int]:
    """(position of the corpus in the blend, its GPTDataset, the sample's index there) of sample ``i`` of a
    top-level dataset: a BlendedDataset maps ``i`` through its two index arrays, a lone GPTDataset is its own."""
    if hasattr(top, "dataset_index"):
        corpus = int(top.dataset_index[i])
        return corpus, top.datasets[corpus], int(top.dataset_sample_index[i])
    return 0, top, int(i)
