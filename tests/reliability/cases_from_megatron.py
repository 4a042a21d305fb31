"""Bad inputs of the catalogue, ``llmjp-ds from-megatron``: LLM-jp's Megatron-LM scripts (copies of the
reconstructions in tests/fixtures/llmjp4/, some altered) that cannot become a config without changing what the run
trains, or without running code. Each is refused in one line and writes no config (``{tmp}/converted.yaml`` stays
absent, an existing output byte-identical)."""

from __future__ import annotations

from pathlib import Path

from tests.reliability.cases import Case, L

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llmjp4"
M = "{tmp}/from_megatron"
OUT = "{tmp}/converted.yaml"


def convert(params: str, data: str | None = f"{M}/train_data.sh", output: str = OUT):
    return L("from-megatron", f"{M}/{params}", *([data] if data else []), "--output", output)


CASES: list[Case] = [
    Case("from-megatron-data-script-runs-code", convert("ipt_params.sh", f"{M}/ipt_train_data.sh"),
         ("--data-path (", "ipt_params.sh:85): `$(calc_base 8 106882005818 ",
          "ipt_train_data.sh:31 runs code to make the words of TRAIN_DATA_PATH, and from-megatron never runs a file it "
          "reads: run ", "ipt_train_data.sh yourself and pass what bash prints of TRAIN_DATA_PATH instead of it: "
          "bash -c 'source ", "ipt_train_data.sh && declare -p TRAIN_DATA_PATH' > train_data_path.sh")),
    Case("from-megatron-dropout-left-at-megatrons-default", convert("no_dropout_params.sh"),
         ("--attention-dropout is left at Megatron-LM's 0.1: llmjp-ds's layers apply no dropout "
          "(model.attention_dropout must be 0); set --attention-dropout 0.0 if the run can train without it",)),
    Case("from-megatron-unknown-argument", convert("z_loss_params.sh"),
         ("--use-z-loss (", "z_loss_params.sh:80) is not an argument from-megatron knows, so whether it changes the "
          "training cannot be told",)),
    Case("from-megatron-count-inside-a-step", convert("fraction_params.sh"),
         ("--lr-warmup-fraction (", "gives 61440 samples, which end inside step 120 of the run's batches: llmjp-ds "
          "counts its schedule in steps; give a count that ends with a step")),
    Case("from-megatron-router-not-computed", convert("sigmoid_params.sh", None),
         ("--moe-router-score-function (", "changes how the router scores or picks experts in a way llmjp-ds does "
          "not compute")),
    Case("from-megatron-output-exists", convert("params.sh", output=f"{M}/existing.yaml"),
         ("existing.yaml already exists: choose another --output (from-megatron never replaces a file)",)),
]


def prepare(ctx) -> None:
    """The scripts, under ``{tmp}/from_megatron``."""
    d = ctx.tmp / "from_megatron"
    d.mkdir()
    base = (FIXTURES / "base" / "params.sh").read_text()
    (d / "params.sh").write_text(base)
    (d / "train_data.sh").write_text((FIXTURES / "base" / "train_data.sh").read_text())
    (d / "ipt_params.sh").write_text((FIXTURES / "decay3m-ipt3.1" / "params.sh").read_text())
    (d / "ipt_train_data.sh").write_text((FIXTURES / "decay3m-ipt3.1" / "train_data.sh").read_text())
    (d / "no_dropout_params.sh").write_text(base.replace("    --attention-dropout 0.0\n", ""))
    (d / "z_loss_params.sh").write_text(base.replace("    --use-mpi\n", "    --use-mpi --use-z-loss\n"))
    (d / "fraction_params.sh").write_text(base.replace("--lr-warmup-iters 2000", "--lr-warmup-fraction 0.00001"))
    moe = (FIXTURES / "moe-291b" / "params.sh").read_text()
    router = "    --moe-router-topk 8\n"
    (d / "sigmoid_params.sh").write_text(moe.replace(router, router + "    --moe-router-score-function sigmoid\n"))
    (d / "existing.yaml").write_text("preset: llmjp4-8b\n")
