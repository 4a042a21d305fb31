"""``llmjp-ds from-megatron``: LLM-jp's Megatron-LM scripts (reconstructions in tests/fixtures/llmjp4/) made into
run configs, compared with megatron-core for the same arguments: every LR and weight decay of the config's first
steps (and around the WSD decay and the last step) against megatron-core's OptimizerParamScheduler built as
Megatron-LM's get_optimizer_param_scheduler builds it, every global batch against its microbatch calculator, and
the blend against its get_blend_from_list. The Megatron side reads the arguments with Megatron-LM's own defaults
(the subset below, as megatron/training/arguments.py declares them), not with from-megatron's tables."""

from __future__ import annotations

import argparse
import subprocess
import warnings
from pathlib import Path

import pytest

from llmjp_ds.config import load_config
from llmjp_ds.data.batch_schedule import BatchSchedule
from llmjp_ds.errors import UserError
from llmjp_ds.interchange.bash_words import Variables, read_variables
from llmjp_ds.interchange.from_megatron import from_megatron, read_arguments
from llmjp_ds.optim.lr_schedule import check_schedule, run_schedule

FIXTURES = Path(__file__).parent / "fixtures" / "llmjp4"
GIVEN = {"ENV_DIR": "/opt/llm-jp", "TASK_DIR": "/work/v4-8b"}


# --- Megatron-LM's side: its argument defaults, its scheduler, its calculator -------------------------------------

def megatron_parse(words: list[str]) -> argparse.Namespace:
    """The arguments as Megatron-LM's argparse reads them (the ones that decide the LR, the batch and the data,
    with megatron/training/arguments.py's defaults; the rest left aside)."""
    p = argparse.ArgumentParser()
    for name, kind, default in [
            ("--lr", float, None), ("--min-lr", float, 0.0), ("--lr-decay-style", str, "linear"),
            ("--lr-wsd-decay-style", str, "exponential"), ("--lr-decay-iters", int, None),
            ("--lr-decay-samples", int, None), ("--lr-wsd-decay-iters", int, None),
            ("--lr-wsd-decay-samples", int, None), ("--lr-warmup-fraction", float, None),
            ("--lr-warmup-iters", int, 0), ("--lr-warmup-samples", int, 0), ("--lr-warmup-init", float, 0.0),
            ("--weight-decay", float, 0.01), ("--start-weight-decay", float, None),
            ("--end-weight-decay", float, None), ("--weight-decay-incr-style", str, "constant"),
            ("--train-iters", int, None), ("--train-samples", int, None), ("--micro-batch-size", int, None),
            ("--global-batch-size", int, None), ("--adam-beta1", float, 0.9), ("--adam-beta2", float, 0.999),
            ("--adam-eps", float, 1e-8), ("--clip-grad", float, 1.0), ("--seed", int, 1234),
            ("--split", str, None), ("--init-method-std", float, 0.02)]:
        p.add_argument(name, type=kind, default=default)
    p.add_argument("--rampup-batch-size", nargs="*", default=None)
    p.add_argument("--data-path", nargs="*", default=None)
    p.add_argument("--override-opt_param-scheduler", action="store_true")
    p.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true")
    args, _ = p.parse_known_args(words)
    args.start_weight_decay = args.weight_decay if args.start_weight_decay is None else args.start_weight_decay
    args.end_weight_decay = args.weight_decay if args.end_weight_decay is None else args.end_weight_decay
    return args


def megatron_scheduler(args: argparse.Namespace, train_iters: int):
    """megatron-core's OptimizerParamScheduler as Megatron-LM's get_optimizer_param_scheduler builds it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    if args.train_iters:
        gbs = args.global_batch_size
        decay = (args.lr_decay_iters or args.train_iters) * gbs
        wd_incr = args.train_iters * gbs
        wsd = None if args.lr_wsd_decay_iters is None else args.lr_wsd_decay_iters * gbs
        warmup = args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None else args.lr_warmup_iters * gbs
    else:
        decay = args.lr_decay_samples or args.train_samples
        wd_incr, wsd = args.train_samples, args.lr_wsd_decay_samples
        warmup = args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None else args.lr_warmup_samples

    class Optimizer:
        param_groups = [{"wd_mult": 1.0}, {"wd_mult": 0.0}]

    opt = Optimizer()
    sched = OptimizerParamScheduler(
        opt, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=decay, lr_decay_style=args.lr_decay_style, start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay, wd_incr_steps=wd_incr, wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler, wsd_decay_steps=wsd,
        lr_wsd_decay_style=args.lr_wsd_decay_style)
    return opt, sched


def megatron_calculator(args: argparse.Namespace):
    from megatron.core.num_microbatches_calculator import (ConstantNumMicroBatchesCalculator,
                                                           RampupBatchsizeNumMicroBatchesCalculator)

    if args.rampup_batch_size:
        return RampupBatchsizeNumMicroBatchesCalculator(args.global_batch_size, args.micro_batch_size, 1, False, 0,
                                                        *[int(x) for x in args.rampup_batch_size])
    return ConstantNumMicroBatchesCalculator(args.global_batch_size, args.micro_batch_size, 1, False, 0)


def megatron_trail(args, windows: list[tuple[int, int]]) -> list[tuple[int, float, float, int]]:
    """(iteration from 0, LR, weight decay of the decayed group, global batch) of each iteration of ``windows``
    (``[first, end)``, increasing), as Megatron-LM's loop gives them: the calculator updated from the consumed
    samples before the iteration, the scheduler stepped by the iteration's batch after it (a jump over the
    iterations between windows, whose batch is the constant one)."""
    opt, sched = megatron_scheduler(args, args.train_iters)
    calc = megatron_calculator(args)
    out, consumed, i = [], 0, 0
    for first, end in windows:
        if first > i:  # past the ramp: whole global batches
            sched.step(increment=(first - i) * args.global_batch_size)
            consumed, i = consumed + (first - i) * args.global_batch_size, first
        for i in range(first, end):
            calc.update(consumed, consistency_check=False)
            batch = calc.get_current_global_batch_size()
            out.append((i, opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"], batch))
            sched.step(increment=batch)
            consumed += batch
        i = end
    return out


def our_trail(cfg, windows: list[tuple[int, int]]) -> list[tuple[int, float, float, int]]:
    schedule, batches = run_schedule(cfg), BatchSchedule.of(cfg.train)
    out = []
    for first, end in windows:
        for i in range(first, end):
            consumed = batches.consumed_at(i)
            out.append((i, schedule.lr(i, consumed), schedule.weight_decay(i, consumed), batches.batch(i, consumed)))
    return out


def same(ours, theirs) -> bool:
    return len(ours) == len(theirs) and all(
        a[0] == b[0] and a[3] == b[3] and a[1] == pytest.approx(b[1], rel=1e-12, abs=1e-18) and
        a[2] == pytest.approx(b[2], rel=1e-12) for a, b in zip(ours, theirs))


def convert(tmp_path, params, data=None, **given):
    """The config from-megatron writes for ``params`` (and ``data``), loaded, and the argument words it read."""
    out = tmp_path / "config.yaml"
    result = from_megatron(params, data, out, {**GIVEN, **given})
    variables = Variables({**GIVEN, **given})
    for path in (data, params):
        if path is not None:
            read_variables(path, variables)
    return load_config(out), [w.text for w in variables.values["ALL_PARAMS"]], result


def windows_of(cfg, first_steps: int = 2100) -> list[tuple[int, int]]:
    """The config's first steps, the steps around its WSD decay's start, and its last steps and two after."""
    schedule, batches, steps = run_schedule(cfg), BatchSchedule.of(cfg.train), cfg.train.steps
    out = [(0, first_steps)]
    if schedule.wsd_decay is not None:
        stable_end = batches.step_at(schedule.decay - schedule.wsd_decay)
        out.append((stable_end - 3, stable_end + 3))
    out.append((steps - 3, steps + 2))
    merged: list[tuple[int, int]] = []
    for first, end in sorted(out):
        if merged and first <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((first, end))
    return merged


def check_against_megatron(cfg, words: list[str]) -> list:
    args = megatron_parse(words)
    check_schedule(cfg.optim, cfg.train.steps)
    windows = windows_of(cfg)
    theirs = megatron_trail(args, windows)
    assert same(our_trail(cfg, windows), theirs)
    if args.data_path:
        from megatron.core.datasets.utils import get_blend_from_list

        prefixes, weights = get_blend_from_list(args.data_path)
        assert cfg.data.blend == [x for w, p in zip(weights, prefixes) for x in (w, p)]
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.data.seed) == \
        (args.global_batch_size, args.micro_batch_size, args.seed)
    assert (cfg.optim.beta1, cfg.optim.beta2, cfg.optim.eps, cfg.optim.clip_grad, cfg.model.init_std) == \
        (args.adam_beta1, args.adam_beta2, args.adam_eps, args.clip_grad, args.init_method_std)
    return theirs


# --- the four scripts ------------------------------------------------------------------------------------------

BASE_WORDS = (
    "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention "
    "--num-query-groups 8 --seq-length 4096 --max-position-embeddings 4096 --position-embedding-type rope "
    "--rotary-base 500000 --untie-embeddings-and-output-weights --swiglu --normalization RMSNorm --norm-epsilon 1e-6 "
    "--disable-bias-linear --tokenizer-type Llama2Tokenizer --tokenizer-model "
    "/opt/llm-jp/src/llm-jp-tokenizer-v4/v4_alpha_1.0.model --optimizer adam --lr 3e-4 --min-lr 3e-5 --adam-beta1 0.9 "
    "--adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0 --weight-decay 0.1 --init-method-std 0.02 --attention-dropout "
    "0.0 --hidden-dropout 0.0 --train-iters 12000000 --lr-warmup-iters 2000 --lr-decay-iters 12000000 --lr-decay-style "
    "WSD --lr-wsd-decay-style linear --lr-wsd-decay-iters 1 --eval-interval 999999999 --eval-iters 0 "
    "--micro-batch-size 1 --global-batch-size 512 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 "
    "--context-parallel-size 1 --sequence-parallel --use-distributed-optimizer --distributed-backend nccl "
    "--distributed-timeout-minutes 120 --use-mpi --data-path 0.0775 "
    "/groups/llm-jp/v4/tokenized/code_stack_0000_text_document 0.5 "
    "/groups/llm-jp/v4/tokenized/en_fineweb_0000_text_document 0.4225 "
    "/groups/llm-jp/v4/tokenized/ja_cc_0000_text_document --data-cache-path /work/v4-8b/cache --split 1,0,0 --bf16 "
    "--use-mcore-models --no-masked-softmax-fusion --use-flash-attn --overlap-grad-reduce --overlap-param-gather "
    "--attention-softmax-in-fp32 --transformer-impl transformer_engine --attention-backend fused").split()


def test_the_stable_run_is_the_llmjp4_8b_preset(tmp_path):
    cfg, words, result = convert(tmp_path, FIXTURES / "base" / "params.sh", FIXTURES / "base" / "train_data.sh")
    assert words == BASE_WORDS  # the script's words, as bash would build the array
    assert result["preset"] == "llmjp4-8b" and cfg.model.shape == "llmjp4-8b"
    assert cfg.optim.min_lr == 3e-5 and cfg.optim.decay_style == "WSD" and cfg.optim.wsd_decay_steps == 1
    assert cfg.parallel.distributed_timeout_s == 7200.0 and cfg.data.split == [1, 0, 0]
    assert cfg.data.tokenizer == "/opt/llm-jp/src/llm-jp-tokenizer-v4/v4_alpha_1.0.model"
    assert cfg.data.cache_dir == "/work/v4-8b/cache" and cfg.train.eval_interval == 0
    theirs = check_against_megatron(cfg, words)
    assert theirs[0][1] == 0.0 and theirs[2000][1] == 3e-4 and theirs[-3][1] == 3e-4 and theirs[-1][1] == 3e-5
    carried_not = [line.split(" (")[0] for line in result["notes"]]
    assert carried_not == ["not carried: the tokenizer's vocabulary", "not carried: --distributed-backend",
                           "not carried: --use-mpi",
                           "not carried: --use-mcore-models", "not carried: --no-masked-softmax-fusion",
                           "not carried: --use-flash-attn", "not carried: --overlap-grad-reduce",
                           "not carried: --overlap-param-gather", "not carried: --transformer-impl",
                           "not carried: --attention-backend"]


def test_decay3m_is_a_branch_from_step_2_9m(tmp_path):
    """decay3m's overrides, appended to the stable run's: 3M iterations, minus_sqrt to LR 0 over the last 100,000
    (from step 2,900,001), the scheduler overridden at the resume."""
    cfg, words, _ = convert(tmp_path, FIXTURES / "decay3m" / "params.sh", FIXTURES / "base" / "train_data.sh")
    assert (cfg.train.steps, cfg.optim.decay_steps, cfg.optim.wsd_decay_steps, cfg.optim.min_lr) == \
        (3_000_000, 3_000_000, 100_000, 0.0)
    assert cfg.optim.wsd_decay_style == "minus_sqrt" and cfg.optim.resume_schedule == "override"
    theirs = check_against_megatron(cfg, words)
    window = {i: lr for i, lr, _, _ in theirs}
    # step 2,900,001 (index 2,900,000) is the branch's first: at the peak, the decay's first sample ahead of it
    assert window[2_900_000] == 3e-4 > window[2_900_001] and window[2_999_999] > 0 == window[3_000_000]


def test_decay3m_ipt3_1_needs_its_data_script_written_out(tmp_path):
    """Its data script makes each --data-path word by running Python: refused in one line naming the line, and the
    command that line gives (bash printing the array) makes a file from-megatron reads; a prefix repeats."""
    params, data = FIXTURES / "decay3m-ipt3.1" / "params.sh", FIXTURES / "decay3m-ipt3.1" / "train_data.sh"
    with pytest.raises(UserError) as err:
        from_megatron(params, data, tmp_path / "refused.yaml", GIVEN)
    message = str(err.value)
    assert "\n" not in message and not (tmp_path / "refused.yaml").exists()
    assert message.startswith(f"--data-path ({params}:85): `$(calc_base 8 106882005818 "
                              "${DATASET_ROOT}/code_olmo-starcoder_0000_text_document)` at "
                              f"{data}:31 runs code to make the words of TRAIN_DATA_PATH, and from-megatron never "
                              f"runs a file it reads: run {data} yourself")
    command = message.split("instead of it: ")[1]
    assert command == f"bash -c 'source {data} && declare -p TRAIN_DATA_PATH' > train_data_path.sh"
    subprocess.run(command, shell=True, check=True, cwd=tmp_path)  # the user's own step, on our fixture
    cfg, words, _ = convert(tmp_path, params, tmp_path / "train_data_path.sh")
    assert (cfg.train.steps, cfg.optim.wsd_decay_steps, cfg.optim.resume_schedule) == (200_000, 100_000, "check")
    prefixes = cfg.data.blend[1::2]
    assert len(prefixes) == 11 and len(set(prefixes)) == 9
    check_against_megatron(cfg, words)


def test_the_moe_run_is_a_qwen3_moe_shape(tmp_path):
    cfg, words, result = convert(tmp_path, FIXTURES / "moe-291b" / "params.sh", FIXTURES / "base" / "train_data.sh")
    m = cfg.model
    assert m.shape == "llmjp4-32b-a3b" and m.init_std == 0.006
    shape = {k: v for k, v in vars(m.overrides).items() if v is not None}
    assert shape == {"hidden_size": 5120, "num_layers": 70, "num_attention_heads": 80, "num_key_value_heads": 8,
                     "ffn_hidden_size": 20480, "moe_ffn_hidden_size": 2048}
    assert (m.moe_aux_loss, m.moe_aux_loss_coeff, m.moe_z_loss_coeff, m.moe_capacity_factor) == \
        ("aux_loss", 1e-2, 1e-3, None)
    assert (cfg.parallel.pipeline_stages, cfg.parallel.distributed_timeout_s) == (6, 600.0)
    check_against_megatron(cfg, words)
    notes = "\n".join(result["notes"])
    assert m.recompute == "moe"  # --recompute-granularity selective --recompute-modules moe
    for name in ("--expert-model-parallel-size", "--num-virtual-stages-per-pipeline-rank",
                 "--moe-per-layer-logging", "--rerun-mode"):
        assert f"not carried: {name} (" in notes


def test_a_ramp_in_samples_is_megatrons(tmp_path):
    """Sample-based arguments with a ramp (Megatron-LM refuses a ramp with --train-iters): the run's iterations as
    update_train_iters counts them, each iteration's batch from the ramp calculator, the LR in samples."""
    params = tmp_path / "params.sh"
    params.write_text(((FIXTURES / "base" / "params.sh").read_text() + """
ALL_PARAMS+=(
    --train-samples 1048576 --lr-decay-samples 1048576 --lr-warmup-samples 65536 --lr-wsd-decay-samples 262144
    --rampup-batch-size 128 128 32768 --lr-decay-style WSD --lr-wsd-decay-style cosine
    --weight-decay-incr-style linear --start-weight-decay 0.01 --end-weight-decay 0.1
)
""").replace("--train-iters 12000000", "").replace("--lr-warmup-iters 2000", "").replace(
        "--lr-decay-iters 12000000", "").replace("--lr-wsd-decay-iters 1\n", "\n"))
    cfg, words, _ = convert(tmp_path, params, FIXTURES / "base" / "train_data.sh")
    assert cfg.train.batch_rampup == [128, 128, 32768]
    theirs = megatron_trail(megatron_parse(words), [(0, cfg.train.steps + 2)])
    assert same(our_trail(cfg, [(0, cfg.train.steps + 2)]), theirs)
    batches = [b for *_, b in theirs]
    assert batches == sorted(batches) and set(batches) == {128, 256, 384, 512}  # the ramp, then the global batch
    assert sum(b for *_, b in theirs[:cfg.train.steps]) <= 1048576 < sum(b for *_, b in theirs[:cfg.train.steps + 1])


# --- the bash it reads, and what it refuses ------------------------------------------------------------------

def words_of(tmp_path, text: str, name: str = "A", **given) -> list:
    script = tmp_path / "s.sh"
    script.write_text(text)
    return read_variables(script, Variables(given)).values.get(name)


def test_bash_words_as_bash_assigns_them(tmp_path):
    text = """
R=/data   # a comment
B=("two words" 'single $R' "$R/x" \\
   last)
A=(--a ${B[@]} --b "${B[@]}" --c $R/y${MISSING:-z} --d "$R" ) # done
A+=(--e \\
    1)
export N=5; A+=(--n $N)
"""
    ours = [w.text for w in words_of(tmp_path, text)]
    assert ours == ["--a", "two", "words", "single", "$R", "/data/x", "last", "--b", "two words", "single $R",
                    "/data/x", "last", "--c", "/data/yz", "--d", "/data", "--e", "1", "--n", "5"]
    bash = subprocess.run(["bash", "-c", text + '\nprintf "%s\\n" "${A[@]}"'], capture_output=True, text=True)
    assert bash.stdout.splitlines() == ours  # bash itself builds the same array


def test_what_bash_would_run_or_decide_is_a_problem_not_a_value(tmp_path):
    text = """
f() {
    A=(--in-function)
    python - << EOF
A=(--in-heredoc $(rm -rf /))
EOF
}
if [ -n "$X" ]; then
    C=1
fi
A=(--code $(cat x) --tick `date` --unset $NOPE --cond $C --given $G)
"""
    words = {w.text: w.problem for w in words_of(tmp_path, text, G="g")}
    assert "--in-function" not in words and "--in-heredoc" not in words
    assert words["$(cat x)"].endswith("runs code to make the words of A")
    assert words["`date`"].startswith("`date` at ") and "runs code" in words["`date`"]
    assert words[""].startswith("$NOPE (at ") and "pass --var NOPE=VALUE" in words[""]
    assert "C is set inside a block (if ... fi) at line 8" in words["1"] and words["g"] == ""


def line_of(path: Path, text: str) -> int:
    return next(n for n, line in enumerate(path.read_text().splitlines(), 1) if text in line)


@pytest.mark.parametrize("edit, line", [
    (("--hidden-dropout 0.0", ""), "--hidden-dropout is left at Megatron-LM's 0.1: llmjp-ds's layers apply no "
                                   "dropout (model.hidden_dropout must be 0)"),
    (("--attention-dropout 0.0", "--attention-dropout 0.1"), "--attention-dropout ("),
    (("--normalization RMSNorm", ""), "--normalization is left at Megatron-LM's LayerNorm, which llmjp-ds does not "
                                      "compute (it computes RMSNorm)"),
    (("--swiglu", ""), "the arguments lack --swiglu: llmjp-ds's model is Llama's (the MLP is SwiGLU)"),
    (("--lr-wsd-decay-style linear", "--lr-wsd-decay-style 1-sqrt"),
     "--lr-wsd-decay-style 1-sqrt (WHERE) is not one llmjp-ds computes (exponential, linear, cosine, minus_sqrt)"),
    (("--use-mpi", "--use-mpi --fp16"), "--fp16 (WHERE) asks for fp16"),
    (("--use-mpi", "--use-mpi --fp8-format hybrid"), "--fp8-format (WHERE) is an FP8 setting"),
    (("--use-mpi", "--use-mpi --use-z-loss"), "--use-z-loss (WHERE) is not an argument from-megatron knows"),
    (("--lr-warmup-iters 2000", "--lr-warmup-iters 2000 --rampup-batch-size 128 128 1000"),
     "--rampup-batch-size (WHERE) with --train-iters: Megatron-LM refuses a ramp"),
    (("--lr-warmup-iters 2000", "--lr-warmup-fraction 0.00001"),
     "--lr-warmup-fraction (WHERE) gives 61440 samples, which end inside step 120 of the run's batches"),
    (("--train-iters 12000000", "--train-iters 12000000 --train-samples 1000"),
     "the arguments give both --train-iters and --train-samples"),
    (("--lr 3e-4", "--lr $(cat lr)"), "--lr (WHERE): `$(cat lr)` at WHERE runs code to make the words of "
                                      "ALL_PARAMS, and from-megatron never runs a file it reads"),
])
def test_a_meaning_that_would_change_is_refused_in_one_line(tmp_path, edit, line):
    params = tmp_path / "params.sh"
    params.write_text((FIXTURES / "base" / "params.sh").read_text().replace(*edit))
    with pytest.raises(UserError) as err:
        from_megatron(params, FIXTURES / "base" / "train_data.sh", tmp_path / "out.yaml", GIVEN)
    message = str(err.value)
    where = f"{params}:{line_of(params, edit[1])}" if edit[1] else ""
    assert line.replace("WHERE", where) in message and "\n" not in message
    assert not (tmp_path / "out.yaml").exists()


def test_an_existing_output_and_a_missing_array_are_refused(tmp_path):
    out = tmp_path / "config.yaml"
    out.write_text("keep: me\n")
    with pytest.raises(UserError, match="already exists: choose another --output"):
        from_megatron(FIXTURES / "base" / "params.sh", None, out)
    assert out.read_text() == "keep: me\n"
    with pytest.raises(UserError, match=r"builds no array PARAMS: pass --array NAME, the array of the run's "
                                        r"arguments \(the arrays of --arguments here: ALL_PARAMS\)"):
        read_arguments(FIXTURES / "base" / "params.sh", array="PARAMS")


def test_finetune_and_paths_the_launch_sets_are_lines_not_refusals(tmp_path):
    params = tmp_path / "params.sh"
    params.write_text((FIXTURES / "decay3m-ipt3.1" / "params.sh").read_text().replace("#--finetune", "--finetune"))
    result = from_megatron(params, None, tmp_path / "out.yaml")
    notes = "\n".join(result["notes"])
    line = line_of(params, "    --finetune")
    assert f"not carried: --finetune ({params}:{line}): a fine-tune start (the weights of --load alone): set " \
           "model.init_from_checkpoint" in notes
    assert f"not carried: --tokenizer-model ({params}:" in notes and "$ENV_DIR is not set in these files (pass --var " \
           "ENV_DIR=VALUE); data.tokenizer stays unset" in notes
    assert "not carried: --data-path (" in notes and "data.blend stays empty" in notes
    cfg = load_config(tmp_path / "out.yaml")
    assert cfg.data.blend == [] and cfg.data.tokenizer is None and cfg.model.init_from_checkpoint is None


def test_the_verb_prints_a_line_per_argument_left_out_and_writes_a_config_the_loader_takes(tmp_path):
    import sys

    out = tmp_path / "decay3m.yaml"
    argv = [sys.executable, "-m", "llmjp_ds.cli", "from-megatron", str(FIXTURES / "decay3m" / "params.sh"),
            str(FIXTURES / "base" / "train_data.sh"), "--output", str(out), "--var", "ENV_DIR=/opt/llm-jp",
            "--var", "TASK_DIR=/work/v4-8b"]
    result = subprocess.run(argv, capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert result.returncode == 0 and result.stderr == "", result.stderr
    lines = result.stdout.splitlines()
    assert all(line.startswith("not carried: ") for line in lines[:-1]) and len(lines) == 11
    assert lines[-1] == f"wrote {out}: preset llmjp4-8b and 11 settings of its own; train it with: llmjp-ds train " \
                        f"--config {out} (or give it to llmjp-ds branch --config, as a branch's settings)"
    text = out.read_text()
    assert text.startswith(f"# llmjp-ds from-megatron {FIXTURES / 'decay3m' / 'params.sh'} ")
    assert all(f"# {line}" in text for line in lines[:-1])
    cfg = load_config(out)
    assert (cfg.train.steps, cfg.optim.min_lr, cfg.optim.resume_schedule) == (3_000_000, 0.0, "override")


def test_context_parallelism_is_a_line_and_the_math_stays(tmp_path):
    params = tmp_path / "params.sh"
    params.write_text((FIXTURES / "base" / "params.sh").read_text().replace("--context-parallel-size 1",
                                                                           "--context-parallel-size 2"))
    result = from_megatron(params, FIXTURES / "base" / "train_data.sh", tmp_path / "out.yaml", GIVEN)
    assert f"not carried: --context-parallel-size 2 ({params}:{line_of(params, '--context-parallel-size')}): " \
           "llmjp-ds keeps each sequence whole on one rank" in "\n".join(result["notes"])
