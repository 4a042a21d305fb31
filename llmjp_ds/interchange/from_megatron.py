"""``llmjp-ds from-megatron PARAMS.sh [TRAIN_DATA.sh] --output config.yaml``: the run config of LLM-jp's Megatron-LM
arguments, written as a preset and the settings that differ from it.

The data script, then the params script, are read as bash assigns their variables (:mod:`.bash_words`; nothing of
either runs), the argument array (``ALL_PARAMS``) taken as Megatron-LM's argparse takes it, and each argument
carried, left out with a line saying why, or refused in one line (:mod:`.megatron_args`). The model shape is the
named shape nearest to the arguments' (``model.shape`` and ``model.overrides`` for the rest); the preset is the one
the fewest settings differ from. The config is built (every check of the loader) before the file is written, and
nothing is written when anything is refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import yaml

from llmjp_ds.config import RUN_PRESETS, RunConfig, build_config, merge, preset_dict
from llmjp_ds.data.tokenizer import load_tokenizer
from llmjp_ds.errors import fail
from llmjp_ds.interchange.bash_words import Variables, read_variables
from llmjp_ds.interchange.megatron_arg_table import NOT_CARRIED
from llmjp_ds.interchange.megatron_args import (Args, batches_of, data_of, evaluation_of, known_or_refused,
                                                model_of, optim_of, parallel_of, parse_arguments, path_words,
                                                precision_of, run_settings_of, shape_of)
from llmjp_ds.io_utils import atomic_file
from llmjp_ds.model.shapes import MODEL_SHAPES, pad_vocab_size

TOKENIZERS = ("Llama2Tokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "HuggingFaceTokenizer")


def read_arguments(params, data=None, given: dict[str, str] | None = None, array: str = "ALL_PARAMS") -> Args:
    """The Megatron-LM arguments of the array ``array`` that ``params`` builds, after ``data`` (the data script the
    launch sources first) and ``given`` (``--var`` values: what the launch script sets)."""
    variables = Variables(given)
    for path in (data, params):
        if path is not None and not Path(path).is_file():
            fail(f"{path} does not exist: pass the params script (and the data script) of the Megatron-LM run")
        if path is not None:
            read_variables(path, variables)
    if array not in variables.values:
        arrays = sorted(k for k, v in variables.values.items() if any(w.text.startswith("--") for w in v))
        fail(f"{params} builds no array {array}: pass --array NAME, the array of the run's arguments"
             + (f" (the arrays of --arguments here: {', '.join(arrays)})" if arrays else ""))
    return Args(parse_arguments(variables.values[array]))


def nearest_shape(fields: dict) -> tuple[str, dict]:
    """The named shape whose fields differ least from ``fields`` (vocabulary aside; ``head_dim`` as the width of a
    head, which a shape may leave to hidden / heads), and ``model.overrides`` for the ones that differ."""
    def differs(name: str) -> dict:
        shape = MODEL_SHAPES[name]
        out = {k: v for k, v in fields.items() if k != "head_dim" and getattr(shape, k) != v}
        resolved = dataclasses.replace(shape, **out)
        if (resolved.head_dim or resolved.hidden_size // resolved.num_attention_heads) != fields["head_dim"]:
            out["head_dim"] = fields["head_dim"]
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}

    name = min(MODEL_SHAPES, key=lambda n: len(differs(n)))
    return name, differs(name)


def _tokenizer(a: Args, shape: str, overrides: dict, tp: int, notes: list[str]) -> str | None:
    """``data.tokenizer``; the embedding's rows as Megatron-LM pads the tokenizer's pieces (into ``overrides``)
    where the tokenizer can be read here."""
    a.one("--tokenizer-type", str, "Llama2Tokenizer", choices=TOKENIZERS)
    rows = MODEL_SHAPES[shape].vocab_size
    stays = f"data.tokenizer stays unset and the embedding keeps {shape}'s {rows} rows, which a run checks the " \
            "tokenizer against"
    words = path_words(a, "--tokenizer-model", notes, stays)
    multiple = a.one("--make-vocab-size-divisible-by", int, 128) * tp
    if not words:
        return None
    if Path(words[0]).exists():
        padded = pad_vocab_size(load_tokenizer(words[0]).vocab_size, multiple)
        if padded != rows:
            overrides["vocab_size"] = padded
    else:
        notes.append(f"not carried: the tokenizer's vocabulary ({a.where('--tokenizer-model')}): {words[0]} is not "
                     f"on this machine, so the embedding keeps {shape}'s {rows} rows, which a run checks the tokenizer "
                     "against")
    return words[0]


def config_values(a: Args, notes: list[str]) -> dict:
    """Every setting the arguments decide, as a nested config dict (``notes``: a line per argument not carried)."""
    known_or_refused(a)
    fields = shape_of(a)
    shape, overrides = nearest_shape(fields)
    model = {"shape": shape, "overrides": overrides, **model_of(a, notes)}
    train, batches = batches_of(a)
    parallel = parallel_of(a, notes)
    data = data_of(a, notes)
    seq = a.one("--seq-length", int)  # the samples' length; the shape's seq_len is --max-position-embeddings
    data["seq_len"] = None if seq == fields["seq_len"] else seq
    tokenizer = _tokenizer(a, shape, overrides, parallel["tensor_parallel"], notes)
    if tokenizer:
        data["tokenizer"] = tokenizer
    runs = run_settings_of(a)
    train.update(evaluation_of(a), skip_steps=runs.pop("skip_steps"))
    phases = RunConfig().to_dict()["precision"]["phases"]  # one phase in precision.dtype: no FP8
    values = {"model": model, "data": data, "optim": optim_of(a, train, batches), "train": train,
              "parallel": parallel, "precision": {**precision_of(a), "phases": phases}, **runs}
    for name, arg in a.args.items():
        if name in NOT_CARRIED:
            notes.append(f"not carried: {name} ({arg.where}): {NOT_CARRIED[name]}")
    notes.sort(key=_written_at)
    return values


def _written_at(note: str) -> tuple:
    """Where a line's argument was written (file, line), for the lines in the files' order; a left-out one last."""
    m = re.search(r"\((.+):(\d+)\)", note)
    return (0, m.group(1), int(m.group(2))) if m else (1, "", 0)


def _differences(base: dict, full: dict) -> dict:
    out = {}
    for key, value in full.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            inner = _differences(base[key], value)
            if inner:
                out[key] = inner
        elif value != base.get(key):
            out[key] = value
    return out


def _leaves(tree) -> int:
    return sum(_leaves(v) for v in tree.values()) if isinstance(tree, dict) else 1


def as_preset_and_overrides(values: dict) -> tuple[str, dict]:
    """The run preset the fewest settings of ``values`` differ from, and those settings."""
    best = None
    for name in RUN_PRESETS:
        base = preset_dict(name)
        diff = _differences(base, merge(base, values))
        if best is None or _leaves(diff) < _leaves(best[1]):
            best = (name, diff)
    return best


def from_megatron(params, data, output, given: dict[str, str] | None = None, array: str = "ALL_PARAMS") -> dict:
    """Write the run config of ``params`` (and ``data``) to ``output``; returns the preset, the settings written
    and the lines of what was not carried. Nothing is written when anything is refused."""
    output = Path(output)
    if output.exists() or output.is_symlink():
        fail(f"{output} already exists: choose another --output (from-megatron never replaces a file)")
    a = read_arguments(params, data, given, array)
    notes: list[str] = []
    values = config_values(a, notes)
    preset, overrides = as_preset_and_overrides(values)
    build_config(merge(preset_dict(preset), values))  # the loader's checks, before anything is written
    sources = " ".join(str(p) for p in (params, data) if p is not None)
    header = [f"# llmjp-ds from-megatron {sources}: preset {preset} and the settings that differ from it"]
    header += [f"# {line}" for line in notes]
    with atomic_file(output, "w") as f:
        f.write("\n".join(header) + "\n")
        yaml.safe_dump({"preset": preset, **overrides}, f, sort_keys=False)
    return {"output": str(output), "preset": preset, "overrides": overrides, "notes": notes}


def _variable(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
    return name, value


def cli_main(argv: list[str], verb: str = "from-megatron") -> int:
    p = argparse.ArgumentParser(
        prog=f"llmjp-ds {verb}",
        description="Write the run config of a Megatron-LM run from LLM-jp's scripts: the argument array that "
                    "PARAMS.sh builds (ALL_PARAMS) and the --data-path words of TRAIN_DATA.sh, read as bash assigns "
                    "them without running either. Each argument is carried into the config, left out with a line "
                    "saying why, or refused in one line when llmjp-ds would train something else (then nothing is "
                    "written).")
    p.add_argument("params", metavar="PARAMS.sh", help="the script that builds the run's arguments")
    p.add_argument("data", metavar="TRAIN_DATA.sh", nargs="?", help="the data script the launch sources first")
    p.add_argument("--output", required=True, help="the config file to write (YAML; must not exist)")
    p.add_argument("--var", dest="given", action="append", type=_variable, default=[], metavar="NAME=VALUE",
                   help="a variable the launch script sets (e.g. ENV_DIR=/opt/llm-jp), repeatable")
    p.add_argument("--array", default="ALL_PARAMS", help="the array of the run's arguments (default: ALL_PARAMS)")
    a = p.parse_args(argv)
    out = from_megatron(a.params, a.data, a.output, dict(a.given), a.array)
    for line in out["notes"]:
        print(line)
    print(f"wrote {out['output']}: preset {out['preset']} and {_leaves(out['overrides'])} settings of its own; train "
          f"it with: llmjp-ds train --config {out['output']} (or give it to llmjp-ds branch --config, as a branch's "
          "settings)")
    return 0
