"""Plant a pickled call in a real checkpoint file (a device check of the safe reader; see h200_trust.sh).

    python benchmarks/device/plant.py TAG_DIR FILE WHERE CANARY [--keep-manifest]

WHERE is ``extra`` (a module's ``_extra_state``: TE's own pickle, replaced) or a top-level key of the file. The
payload runs ``touch CANARY`` if anything unpickles it. The manifest entry is rewritten to match (an attacker
who can write the file can write the manifest) unless ``--keep-manifest``, which leaves a checksum mismatch.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path

import torch


class Payload:
    def __init__(self, canary: str):
        self.canary = canary

    def __reduce__(self):
        return os.system, (f"touch '{self.canary}'",)


def main(tag_dir: str, name: str, where: str, canary: str, keep_manifest: bool) -> None:
    path = Path(tag_dir) / name
    state = torch.load(path, map_location="cpu", weights_only=False)
    if where == "extra":
        keys = [k for k, v in state["module"].items() if k.endswith("_extra_state") and isinstance(v, torch.Tensor)
                and v.dtype == torch.uint8 and v.numel()]
        print(f"{len(keys)} non-empty TE extra states in {name}; replacing {keys[0]}")
        state["module"][keys[0]] = torch.frombuffer(bytearray(pickle.dumps({"recipe": Payload(canary)})),
                                                    dtype=torch.uint8)
    else:
        state[where] = Payload(canary)
    torch.save(state, path)
    if not keep_manifest:
        from llmjp_ds.checkpoint.manifest import digest

        marker = Path(tag_dir) / "llmjp_ds.json"
        data = json.loads(marker.read_text())
        data["files"][name] = digest(path)
        marker.write_text(json.dumps(data))


if __name__ == "__main__":
    main(*sys.argv[1:5], keep_manifest="--keep-manifest" in sys.argv)
