"""Megatron-LM's command-line arguments as the run config's values: what ``llmjp-ds from-megatron`` writes.

:func:`parse_arguments` groups the words of an argument list (``--name value ...``, the last of a repeated argument
winning, as Megatron-LM's argparse takes it); :func:`convert` gives the config values they mean, with Megatron-LM's
own defaults for the arguments left out (its ``--adam-beta2`` is 0.999, its ``--lr-decay-style`` linear, its
dropout 0.1), and one line for each argument it does not carry, saying why. An argument whose meaning llmjp-ds
cannot keep (dropout, LayerNorm, a router llmjp-ds does not compute, a value the files leave to the running script)
and an argument it does not know are refused in one line: the written config never trains something else without
saying so. Counts in samples (``--train-samples``, ``--lr-*-samples``) become steps of the batch schedule that reads
them, as Megatron-LM's ``update_train_iters`` counts the run's iterations, and are refused where a count ends inside
a step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmjp_ds.config import DECAY_STYLES, WSD_DECAY_STYLES, WEIGHT_DECAY_INCR_STYLES
from llmjp_ds.data.batch_schedule import BatchSchedule, changes_at_thresholds, megatron_step_schedule
from llmjp_ds.errors import fail
from llmjp_ds.interchange.bash_words import Word
from llmjp_ds.interchange.megatron_arg_table import CARRIED, NOT_CARRIED, REFUSED
from llmjp_ds.model.options import DROP_POLICIES, MOE_AUX_LOSSES


@dataclass(frozen=True)
class Arg:
    """One argument: its name (``--lr``; ``_`` read as ``-``, as argparse's spellings agree), its value words, and
    where its name was written."""

    name: str
    words: tuple[Word, ...]
    where: str


def parse_arguments(words: list[Word]) -> dict[str, Arg]:
    """Megatron-LM's arguments of an argument list, by name; a repeated one keeps its last values."""
    args: dict[str, Arg] = {}
    current: list | None = None
    for w in words:
        if w.text.startswith("--") and not w.problem:
            name = "--" + w.text[2:].replace("_", "-")
            current = [name, [], w.where]
            args.pop(name, None)  # a repeated argument moves to where it was given last
            args[name] = current
        elif current is None:
            fail(f"{w.where}: {w.problem or repr(w.text)} comes before any --argument: Megatron-LM's arguments are "
                 "--name value ...; fix the array")
        else:
            current[1].append(w)
    return {name: Arg(name, tuple(values), where) for name, (_, values, where) in args.items()}


class Args:
    """The arguments of one run, read by name, each value refused where it cannot be taken as written."""

    def __init__(self, args: dict[str, Arg]):
        self.args = args

    def __contains__(self, name: str) -> bool:
        return name in self.args

    def flag(self, name: str) -> bool:
        arg = self.args.get(name)
        if arg is not None and arg.words:
            fail(f"{name} ({arg.where}) takes no value, got {' '.join(w.text for w in arg.words)!r}: fix the array")
        return arg is not None

    def words(self, name: str) -> list[str] | None:
        """The value words of ``name`` (None when it is not given), refused where one cannot be taken as written."""
        arg = self.args.get(name)
        if arg is None:
            return None
        bad = next((w for w in arg.words if w.problem), None)
        if bad is not None:
            fail(f"{name} ({arg.where}): {bad.problem}, and from-megatron never runs a file it reads: "
                 f"{fix_for(bad.problem, name)}")
        return [w.text for w in arg.words]

    def one(self, name: str, kind, default=None, choices=()):
        """The one value of ``name`` as ``kind`` (int, float or str), ``default`` when not given."""
        values = self.words(name)
        if values is None:
            if choices and default is not None and default not in choices:
                fail(f"{name} is left at Megatron-LM's {default}, which llmjp-ds does not compute (it computes "
                     f"{', '.join(map(str, choices))}): the run cannot be carried")
            return default
        where = self.args[name].where
        if len(values) != 1:
            fail(f"{name} ({where}) takes one value, got {len(values)} ({' '.join(values)!r}): fix the array")
        try:
            value = _number(values[0]) if kind is int else kind(values[0])
        except ValueError:
            fail(f"{name} ({where}) {values[0]!r} is not {'an integer' if kind is int else 'a number'}: fix the array")
        if choices and value not in choices:
            fail(f"{name} {value} ({where}) is not one llmjp-ds computes ({', '.join(map(str, choices))}): the run "
                 "would train another way than Megatron-LM's; change it, or remove it from a copy of the file")
        return value

    def where(self, name: str) -> str:
        return self.args[name].where


def _number(text: str) -> int:
    """An integer as Megatron-LM's argparse reads one, or one written as a float that is whole (``1e6``)."""
    try:
        return int(text)
    except ValueError:
        value = float(text)
        if not value.is_integer():
            raise
        return int(value)


def fix_for(problem: str, name: str) -> str:
    """How to give ``name`` words that can be taken as written, after ``problem``."""
    made = re.search(r" at (\S+):\d+ runs code to make the words of (\w+)", problem)
    if made:
        script, array = made.groups()
        return (f"run {script} yourself and pass what bash prints of {array} instead of it: bash -c 'source {script} "
                f"&& declare -p {array}' > {array.lower()}.sh")
    if "pass --var" in problem:
        return "pass its value with --var NAME=VALUE"
    return f"give {name} a value written out in the file"


def refuse(a: Args, name: str, why: str) -> None:
    fail(f"{name} ({a.where(name)}) {why}")


def known_or_refused(a: Args) -> None:
    """Every argument is one llmjp-ds carries, leaves out with a reason, or refuses with one."""
    for name in a.args:
        if name in REFUSED:
            refuse(a, name, REFUSED[name])
        if name not in CARRIED and name not in NOT_CARRIED:
            refuse(a, name, "is not an argument from-megatron knows, so whether it changes the training cannot be "
                            "told: remove it from a copy of the file if it changes nothing llmjp-ds computes, or set "
                            "its equivalent in the written config (docs/llmjp4-recipe.md lists the arguments)")


def shape_of(a: Args) -> dict:
    """The model shape's fields the arguments give (Megatron-LM's defaults for the ones left out)."""
    for name in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length"):
        if name not in a:
            fail(f"the arguments give no {name}, which Megatron-LM needs: add it")
    hidden, heads = a.one("--hidden-size", int), a.one("--num-attention-heads", int)
    seq = a.one("--seq-length", int)
    groups = a.one("--num-query-groups", int, 1) if a.flag("--group-query-attention") else heads
    a.one("--num-query-groups", int)
    shape = {"num_layers": a.one("--num-layers", int), "hidden_size": hidden, "num_attention_heads": heads,
             "num_key_value_heads": groups, "ffn_hidden_size": a.one("--ffn-hidden-size", int, 4 * hidden),
             "seq_len": a.one("--max-position-embeddings", int, seq),
             "rope_theta": a.one("--rotary-base", float, 10000.0), "rms_norm_eps": a.one("--norm-epsilon", float, 1e-5),
             "head_dim": a.one("--kv-channels", int, hidden // heads), "qk_norm": a.flag("--qk-layernorm")}
    _architecture(a)
    experts = a.one("--num-experts", int, 0)
    shape.update(num_experts=0, experts_per_token=0, moe_ffn_hidden_size=None, dense_layers=())
    if experts:
        if not shape["qk_norm"]:
            fail(f"--num-experts ({a.where('--num-experts')}) without --qk-layernorm: llmjp-ds's MoE model is Hugging "
                 "Face's qwen3_moe, which normalises queries and keys; add --qk-layernorm if the run had it")
        shape.update(num_experts=experts, experts_per_token=a.one("--moe-router-topk", int, 2),
                     moe_ffn_hidden_size=a.one("--moe-ffn-hidden-size", int, shape["ffn_hidden_size"]))
        a.one("--moe-layer-freq", int, 1, choices=(1,))
    return shape


def _architecture(a: Args) -> None:
    """What llmjp-ds's layers are and Megatron-LM's default is not: each must be asked for."""
    for name, why in (("--swiglu", "the MLP is SwiGLU"), ("--untie-embeddings-and-output-weights",
                                                           "the embedding and the output layer are separate weights"),
                      ("--disable-bias-linear", "the linear layers have no bias")):
        if not a.flag(name):
            fail(f"the arguments lack {name}: llmjp-ds's model is Llama's ({why}), Megatron-LM's default is not; the "
                 "run cannot be carried")
    a.one("--position-embedding-type", str, "learned_absolute", choices=("rope",))
    a.one("--normalization", str, "LayerNorm", choices=("RMSNorm",))
    a.one("--rotary-percent", float, 1.0, choices=(1.0,))
    a.flag("--no-position-embedding")
    a.flag("--attention-softmax-in-fp32")
    for name in ("--attention-dropout", "--hidden-dropout"):
        if a.one(name, float, 0.1) != 0:
            where = f"({a.where(name)}) is {a.one(name, float)}" if name in a else "is left at Megatron-LM's 0.1"
            fail(f"{name} {where}: llmjp-ds's layers apply no dropout (model.{name[2:].replace('-', '_')} must be 0); "
                 f"set {name} 0.0 if the run can train without it")


def model_of(a: Args, notes: list[str]) -> dict:
    """``model.*`` besides the shape: the initialisation, the z-loss, an MoE model's router, recompute (``notes``:
    a line for what is not carried)."""
    out = {"init_std": a.one("--init-method-std", float, 0.02), "z_loss": 0.0,
           "attention_dropout": 0.0, "hidden_dropout": 0.0}
    if a.one("--num-experts", int, 0):
        capacity = a.one("--moe-expert-capacity-factor", float)
        out.update(moe_aux_loss=a.one("--moe-router-load-balancing-type", str, "aux_loss", choices=MOE_AUX_LOSSES),
                   moe_aux_loss_coeff=a.one("--moe-aux-loss-coeff", float, 0.0),
                   moe_z_loss_coeff=a.one("--moe-z-loss-coeff", float, 0.0), moe_capacity_factor=capacity,
                   moe_drop_policy=a.one("--moe-token-drop-policy", str, "probs", choices=DROP_POLICIES))
        if a.one("--moe-router-dtype", str, None, choices=("fp32",)) is None:
            notes.append("not carried: --moe-router-dtype (left out): Megatron-LM's router computes in the weights' "
                         "dtype without it, llmjp-ds's in fp32 (as --moe-router-dtype fp32)")
    granularity = a.one("--recompute-granularity", str, "selective" if a.flag("--recompute-activations") else None,
                        choices=("selective", "full"))
    modules = a.words("--recompute-modules")
    if granularity == "full" or (granularity == "selective" and modules in (None, ["core_attn"])):
        out["recompute"] = granularity
    elif granularity == "selective" and modules == ["moe"] and a.one("--num-experts", int, 0):
        out["recompute"] = "moe"
    elif modules:
        notes.append(f"not carried: --recompute-modules {' '.join(modules)} ({a.where('--recompute-modules')}): "
                     "llmjp-ds recomputes the attention core (selective), an MoE model's MoE blocks (moe) or whole "
                     "layers (full) (model.recompute); recompute changes memory and time, not the result")
    return out


def batches_of(a: Args) -> tuple[dict, BatchSchedule]:
    """``train.*`` of the batch and the run's length, and the batch schedule the sample counts are read in."""
    for name in ("--global-batch-size", "--micro-batch-size"):
        if name not in a:
            fail(f"the arguments give no {name}: Megatron-LM's default depends on the launch; add it")
    gbs, ramp = a.one("--global-batch-size", int), a.words("--rampup-batch-size")
    train = {"global_batch_size": gbs, "micro_batch_size": a.one("--micro-batch-size", int),
             "batch_rampup": [int(x) for x in ramp] if ramp else None, "batch_changes": []}
    text = a.one("--step-batch-size-schedule", str)
    if text:
        changes = changes_at_thresholds(megatron_step_schedule(text, a.one("--seq-length", int)))
        train["batch_changes"] = [{"start_step": s, "global_batch_size": b} for s, b in changes]
    batches = BatchSchedule(gbs, tuple(train["batch_rampup"]) if ramp else None,
                            tuple((s - 1, b) for s, b in changes) if text else ())
    iters, samples = a.one("--train-iters", int), a.one("--train-samples", int)
    if (iters is None) == (samples is None):
        fail("the arguments give " + ("both --train-iters and --train-samples" if iters else "neither --train-iters "
                                      "nor --train-samples") + ": Megatron-LM needs exactly one; fix the array")
    if iters and ramp:
        refuse(a, "--rampup-batch-size", "with --train-iters: Megatron-LM refuses a ramp in iteration-based "
                                         "training; give --train-samples")
    if samples and text:
        refuse(a, "--step-batch-size-schedule", "with --train-samples: from-megatron counts the iterations of "
                                                "--train-samples over a constant batch or a ramp only; give "
                                                "--train-iters")
    train["steps"] = iters or megatron_train_iters(samples, batches, train["batch_rampup"])
    return train, batches


def megatron_train_iters(samples: int, batches: BatchSchedule, ramp) -> int:
    """The iterations Megatron-LM runs for ``--train-samples`` (its ``update_train_iters``: the ramp's iterations
    one by one, then whole global batches, the last partial one dropped)."""
    step = consumed = 0
    while ramp and consumed <= int(ramp[2]) and consumed <= samples:
        consumed, step = consumed + batches.batch(step, consumed), step + 1
    if samples > consumed:
        step += (samples - consumed) // batches.global_batch
    return step


def optim_of(a: Args, train: dict, batches: BatchSchedule) -> dict:
    """``optim.*``: AdamW's settings and the LR schedule, its counts in steps of ``batches``."""
    if "--lr" not in a:
        fail("the arguments give no --lr: add it")
    a.one("--optimizer", str, "adam", choices=("adam",))
    wd = a.one("--weight-decay", float, 0.01)
    start, end = a.one("--start-weight-decay", float, wd), a.one("--end-weight-decay", float, wd)
    if a.flag("--override-opt-param-scheduler") and a.flag("--use-checkpoint-opt-param-scheduler"):
        refuse(a, "--use-checkpoint-opt-param-scheduler", "with --override-opt-param-scheduler: Megatron-LM refuses "
                                                          "both; keep one")
    out = {"schedule": "megatron", "lr": a.one("--lr", float), "min_lr": a.one("--min-lr", float, 0.0),
           "min_lr_ratio": None, "warmup_init_lr": a.one("--lr-warmup-init", float, 0.0),
           "decay_style": a.one("--lr-decay-style", str, "linear", choices=DECAY_STYLES),
           "wsd_decay_style": a.one("--lr-wsd-decay-style", str, "exponential", choices=WSD_DECAY_STYLES),
           "beta1": a.one("--adam-beta1", float, 0.9), "beta2": a.one("--adam-beta2", float, 0.999),
           "eps": a.one("--adam-eps", float, 1e-8), "clip_grad": a.one("--clip-grad", float, 1.0),
           "weight_decay": start, "end_weight_decay": None if end == start else end,
           "weight_decay_incr_style": a.one("--weight-decay-incr-style", str, "constant",
                                            choices=WEIGHT_DECAY_INCR_STYLES),
           "resume_schedule": "override" if a.flag("--override-opt-param-scheduler") else
           "checkpoint" if a.flag("--use-checkpoint-opt-param-scheduler") else "check"}
    out.update(_schedule_counts(a, train, batches))
    return out


def _schedule_counts(a: Args, train: dict, batches: BatchSchedule) -> dict:
    """The warm-up, decay and WSD decay lengths in steps, as Megatron-LM's get_optimizer_param_scheduler counts
    them (iterations x global batch, or samples)."""
    iters, gbs = "--train-iters" in a, batches.global_batch
    unit = "iters" if iters else "samples"
    other = "samples" if iters else "iters"
    for name in ("--lr-decay-", "--lr-wsd-decay-", "--lr-warmup-"):
        if f"{name}{other}" in a and (name != "--lr-warmup-" or a.one(f"{name}{other}", int)):
            refuse(a, f"{name}{other}", f"with --train-{unit}: Megatron-LM counts a run in one unit; give {name}{unit}")

    def steps(name: str, samples: float) -> int:
        step = batches.step_at(int(samples))
        if samples != int(samples) or batches.consumed_at(step) != samples:
            refuse(a, name, f"gives {samples:g} samples, which end inside step {step} of the run's batches: llmjp-ds "
                            "counts its schedule in steps; give a count that ends with a step")
        return step

    scale = gbs if iters else 1
    total = train["steps"] * gbs if iters else a.one("--train-samples", int)
    decay = a.one(f"--lr-decay-{unit}", int)
    decay_samples = total if decay is None else decay * scale
    if decay is None and batches.consumed_at(train["steps"]) == total:
        out = {"decay_steps": None}  # train.steps', as Megatron's default
    else:
        out = {"decay_steps": steps(f"--lr-decay-{unit}" if decay is not None else f"--train-{unit}", decay_samples)}
    fraction = a.one("--lr-warmup-fraction", float)
    warmup = a.one(f"--lr-warmup-{unit}", int, 0)
    out["warmup_steps"] = steps("--lr-warmup-fraction", fraction * decay_samples) if fraction is not None else \
        steps(f"--lr-warmup-{unit}", warmup * scale)
    wsd = a.one(f"--lr-wsd-decay-{unit}", int)
    if wsd is not None:
        end = out["decay_steps"] or train["steps"]
        out["wsd_decay_steps"] = end - steps(f"--lr-wsd-decay-{unit}", batches.consumed_at(end) - wsd * scale)
    if a.one("--weight-decay-incr-style", str, "constant") != "constant" and \
            batches.consumed_at(train["steps"]) != total:
        read = batches.consumed_at(train["steps"])
        refuse(a, f"--train-{unit}", f"gives {total} samples and the run's batches {read}, and the weight decay rises "
                                     "over the first: llmjp-ds raises it over the samples of train.steps; give a count "
                                     "the batches reach")
    return out


def path_words(a: Args, name: str, notes: list[str], stays: str) -> list[str] | None:
    """The words of a path argument, or None with a line in ``notes`` when they name a variable the files do not
    set (the launch script's): the config keeps ``stays`` then."""
    arg = a.args.get(name)
    unset = next((w for w in arg.words if "is not set in these files" in w.problem), None) if arg else None
    if unset is None:
        return a.words(name)
    notes.append(f"not carried: {name} ({arg.where}): {unset.problem.replace(f' (at {arg.where})', '')}; {stays}")
    return None


def data_of(a: Args, notes: list[str]) -> dict:
    """``data.*``: Megatron's sample order, the blend, the split, the seed, the index cache (``notes``: a line for
    a path the files leave to the launch script)."""
    out = {"order": "megatron", "seed": a.one("--seed", int, 1234)}
    cache = path_words(a, "--data-cache-path", notes, "data.cache_dir stays unset (the index files go beside the "
                                                      "corpora)")
    if cache:
        out["cache_dir"] = cache[0]
    split = a.one("--split", str, "969, 30, 1")
    try:
        out["split"] = [int(x) if float(x).is_integer() else float(x) for x in split.replace(" ", "").split(",")]
    except ValueError:
        refuse(a, "--split", f"{split!r} is not comma-separated shares: fix the array")
    blend = path_words(a, "--data-path", notes, "data.blend stays empty: give the data script (TRAIN_DATA.sh) or "
                                                "set data.blend")
    if blend:
        if len(blend) % 2 or not all(_is_number(w) for w in blend[::2]):
            if len(blend) > 1:
                refuse(a, "--data-path", "lists prefixes without weights: give each its weight (W1 P1 W2 P2 ...), as "
                                         "data.blend takes them")
            out["blend"] = list(blend)
        else:
            out["blend"] = [x for w, p in zip(blend[::2], blend[1::2]) for x in (float(w), p.strip())]
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def evaluation_of(a: Args) -> dict:
    """``train.eval_*``: Megatron-LM validates every --eval-interval iterations on --eval-iters batches; 0 batches
    is no validation."""
    batches = a.one("--eval-iters", int, 100)
    return {"eval_interval": a.one("--eval-interval", int, 1000) if batches else 0, "eval_batches": batches}


def parallel_of(a: Args, notes: list[str]) -> dict:
    """``parallel.*``: TP, PP, sequence parallelism, ZeRO-1 for the distributed optimizer, the collectives'
    timeout (``notes``: a line for context parallelism, which llmjp-ds does not have)."""
    tp = a.one("--tensor-model-parallel-size", int, 1)
    out = {"tensor_parallel": tp, "pipeline_stages": a.one("--pipeline-model-parallel-size", int, 1),
           "sequence_parallel": None if a.flag("--sequence-parallel") or tp == 1 else False,
           "zero_stage": 1 if a.flag("--use-distributed-optimizer") else 0,
           "distributed_timeout_s": 60.0 * a.one("--distributed-timeout-minutes", float, 10.0)}
    cp = a.one("--context-parallel-size", int, 1)
    if cp > 1:
        notes.append(f"not carried: --context-parallel-size {cp} ({a.where('--context-parallel-size')}): llmjp-ds "
                     "keeps each sequence whole on one rank (the same math; parallel.* has TP, PP and ZeRO data "
                     "parallelism)")
    return out


def precision_of(a: Args) -> dict:
    """``precision.dtype``: BF16 or Megatron-LM's default fp32, with no FP8 phase."""
    return {"dtype": "bf16" if a.flag("--bf16") else "fp32"}


def run_settings_of(a: Args) -> dict:
    """What the arguments say of saves and logging that has a key here."""
    out: dict = {"checkpoint": {}, "logging": {}}
    if "--save-interval" in a:
        out["checkpoint"]["interval"] = a.one("--save-interval", int)
    if "--log-interval" in a:
        out["logging"]["interval"] = a.one("--log-interval", int)
    for name, key in (("--wandb-project", "project"), ("--wandb-exp-name", "run_name")):
        if name in a:
            out["logging"][key] = a.one(name, str)
    skips = a.words("--iterations-to-skip")
    return {**out, "skip_steps": [[int(x), int(x)] for x in skips] if skips else []}
