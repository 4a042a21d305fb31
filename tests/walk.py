"""The files of llmjp_ds one training step opens on its way to the loss, measured: ``python -m tests.walk RUN_DIR``
trains the demo preset for one step on the CPUs with a profile hook on from the start of the step until the loss
function first returns, and prints the package's files whose functions it entered, one per line, in the order it
first entered them (docs/architecture.md's walk is checked against this list)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "llmjp_ds"


def main(run_dir: str) -> None:
    from llmjp_ds.train import cli_main
    from llmjp_ds.trainer import trainer

    seen: dict[str, None] = {}
    done = []

    def hook(frame, event, arg):
        name = frame.f_code.co_filename
        if done or not name.startswith(str(PACKAGE)):
            return
        if event == "call":
            seen.setdefault(os.path.relpath(name, PACKAGE), None)
        elif event == "return" and name.endswith(os.path.join("model", "loss.py")):
            done.append(True)

    step = trainer.Trainer._loop_step

    def traced(self):
        sys.setprofile(hook)
        try:
            return step(self)
        finally:
            sys.setprofile(None)

    trainer.Trainer._loop_step = traced
    cli_main(["--preset", "demo", "--set", "train.steps=1", "--set", f"run_dir={run_dir}", "--set",
              "logging.wandb=disabled", "--set", "train.eval_interval=0", "--set", "logging.progress=false"])
    print("WALK " + " ".join(seen), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
