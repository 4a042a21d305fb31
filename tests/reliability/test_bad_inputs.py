"""The catalogue of bad inputs (docs/errors.md): each through the real CLI, as a subprocess.

Every case must: exit non-zero; print exactly one line on stderr, ``error: ...``, naming the problem and the
fix (the expected fragments below); show no traceback; touch no existing file; and, for training, fail
before DeepSpeed starts (no process group: none of its start-up lines, and within seconds). ``--debug`` turns
the line into a traceback (one case). Each case id is a row of docs/errors.md; a test checks they agree.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.reliability import cases_checkpoint, cases_cluster, cases_config, cases_data, cases_from_megatron
from tests.reliability.cases import FP8, SMALL, Case, L, T, sub
from tests.reliability.conftest import (
    DEEPSPEED_STARTED, REPO, TINY, assert_latest_complete, check_ok, latest_of, run, subprocess_env, train_argv,
)

DOCS = REPO / "docs" / "errors.md"
WORKERS = int(os.environ.get("LLMJP_DS_TEST_WORKERS", "2"))
SECONDS = 30  # "within seconds": ~1-4 s here, generous for a loaded 2-core CI box



CASES = [
    # --- command line and config files -------------------------------------------------------------------
    Case("unknown-verb", L("trian"), ("unknown verb `trian` (did you mean 'train'?)", "llmjp-ds --help")),
    Case("unknown-config-key", T("train.stepz=3"), ("unknown config key 'train.stepz' (did you mean 'steps'?)",)),
    Case("unknown-section-in-file", L("train", "--config", "{tmp}/typo.yaml"),
         ("unknown config key 'optimm' (did you mean 'optim'?)",)),
    Case("wrong-type-int", T("train.steps=ten"), ("config key 'train.steps' must be int, got 'ten'",)),
    Case("wrong-type-float", T("optim.lr=fast"), ("config key 'optim.lr' must be float, got 'fast'",)),
    Case("section-not-a-mapping", T("optim=3"), ("config section optim must be a mapping, got int",)),
    Case("set-without-value", T("optim.lr"), ("--set 'optim.lr' must look like key=value, e.g. optim.lr=1e-4",)),
    Case("missing-config-file", lambda c: ["-m", "llmjp_ds.train", "--config", str(c.tmp / "nope.yaml")],
         ("nope.yaml does not exist: pass the path of a YAML or JSON run config",)),
    Case("malformed-yaml", lambda c: ["-m", "llmjp_ds.cli", "train", "--config", str(c.tmp / "broken.yaml")],
         ("cannot parse config file", "broken.yaml", "at line 2, column 1; fix the syntax there")),
    Case("config-file-not-a-mapping", lambda c: ["-m", "llmjp_ds.train", "--config", str(c.tmp / "list.yaml")],
         ("holds a list, not a mapping of sections",)),
    Case("unknown-run-preset", lambda c: ["-m", "llmjp_ds.train", "--preset", "llmjp3-7b"],
         ("unknown run preset 'llmjp3-7b' (did you mean 'llmjp3-3.7b'?): choose one of demo,",)),
    Case("unknown-model-shape", T("model.shape=huge"), ("unknown model shape 'huge'", "choose one of tiny,")),
    Case("renamed-config-key", T("model.preset=tiny"), ("config key 'model.preset' was renamed 'model.shape'",)),
    Case("unknown-model-override", T("model.overrides={hidden: 64}"),
         ("unknown config key 'model.overrides.hidden' (did you mean 'hidden_size'?)",)),
    Case("model-override-wrong-type", T("model.overrides={num_layers: two}"),
         ("config key 'model.overrides.num_layers' must be int or null, got 'two'",)),
    Case("model-override-not-positive", T("model.overrides={num_layers: 0}"),
         ("model.overrides.num_layers must be a positive int, got 0",)),
    # --- arithmetic that must agree ----------------------------------------------------------------------
    Case("batch-not-divisible", T("train.global_batch_size=7", "train.micro_batch_size=2"),
         ("train.global_batch_size=7 is not divisible by micro_batch_size x data parallel = 2 x 1: make it a "
          "multiple of 2",)),
    Case("zero3-with-pipeline", T("parallel.pipeline_stages=2", "parallel.zero_stage=3"),
         ("ZeRO-3 cannot be combined with pipeline parallelism", "use parallel.zero_stage=1")),
    Case("unknown-partition-method", T("parallel.pipeline_stages=2", "parallel.partition_method=profile"),
         ("unknown parallel.partition_method 'profile': use flops, parameters, uniform or type:<layer class regex>",)),
    Case("more-stages-than-layers", T("parallel.pipeline_stages=8"),
         ("parallel.pipeline_stages=8 exceeds the model's 4 layers: use at most 4 stages",)),
    Case("world-size-vs-stages", T("parallel.pipeline_stages=2"),
         ("world size 3 is not divisible by tensor_parallel x pipeline_stages = 1 x 2: launch a multiple of 2 ranks",),
         env={"WORLD_SIZE": "3"}),
    Case("tp-heads-not-divisible", T("parallel.tensor_parallel=3"),
         ("the model's num_attention_heads 4 is not divisible by parallel.tensor_parallel=3: choose a "
          "tensor_parallel that divides it (2, 4)",), env={"WORLD_SIZE": "3"}),
    Case("tp-spans-nodes", T("parallel.tensor_parallel=2"),
         ("parallel.tensor_parallel=2 does not divide the 1 GPUs (slots) of a node: a TP group would span two "
          "nodes",), env={"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}),
    Case("tp-sequence-not-divisible", T("parallel.tensor_parallel=2", "data.seq_len=33"),
         ("data.seq_len 33 is not divisible by parallel.tensor_parallel=2", "parallel.sequence_parallel=false"),
         env={"WORLD_SIZE": "2"}),
    Case("sequence-parallel-without-tp", T("parallel.sequence_parallel=true"),
         ("parallel.sequence_parallel shards the sequence over the tensor-parallel group: set "
          "parallel.tensor_parallel > 1",)),
    Case("zero3-with-tensor-parallel", T("parallel.tensor_parallel=2", "parallel.zero_stage=3"),
         ("ZeRO-3 is not supported with tensor parallelism: use parallel.zero_stage=1",), env={"WORLD_SIZE": "2"}),
    Case("recompute-unknown", T("model.recompute=partial"),
         ("model.recompute must be one of none, selective, full, moe, got 'partial'",)),
    Case("attention-core-unknown", T("model.attention_core=flash"),
         ("model.attention_core must be one of te, cudnn, got 'flash'",)),
    Case("lr-schedule-unknown", T("optim.schedule=megatorn"),
         ("optim.schedule must be one of llmjp, megatron, got 'megatorn' (did you mean 'megatron'?)",)),
    Case("activation-checkpointing-replaced", T("model.activation_checkpointing=true"),
         ("config key 'model.activation_checkpointing' was replaced by 'model.recompute': use model.recompute=full "
          "(was true)",)),
    Case("seq-len-over-max-positions", T("data.seq_len=512"),
         ("data.seq_len=512 exceeds the model's max_position_embeddings 256: lower it or set "
          "model.overrides.seq_len",)),
    Case("lr-ratio-out-of-range", T("optim.min_lr_ratio=2"),
         ("optim.lr must be > 0 and optim.min_lr_ratio in [0, 1], got lr=0.003, min_lr_ratio=2",)),
    Case("warmup-negative", T("optim.warmup_steps=-5"), ("optim.warmup_steps must be >= 0, got -5",)),
    Case("zero-steps", T("train.steps=0"), ("train.steps must be positive, got 0",)),
    Case("zero-stage-4", T("parallel.zero_stage=4"), ("parallel.zero_stage must be 0, 1, 2 or 3, got 4",)),
    Case("logging-interval-zero", T("logging.interval=0"), ("logging.interval must be >= 1",)),
    Case("max-nonfinite-zero", T("train.max_nonfinite_steps=0"), ("train.max_nonfinite_steps must be >= 1",)),
    Case("stall-timeout-zero", T("parallel.stall_timeout_s=0"), ("parallel.stall_timeout_s must be > 0",)),
    Case("grace-time-zero", T("checkpoint.grace_seconds=0"), ("checkpoint.grace_seconds must be > 0",)),
    Case("keep-last-zero", T("checkpoint.keep_last=0"), ("checkpoint.keep_last must be >= 1, got 0",)),
    Case("wandb-mode-typo", T("logging.wandb=ofline"),
         ("logging.wandb must be online, offline or disabled, got 'ofline' (did you mean 'offline'?)",)),
    # --- precision ---------------------------------------------------------------------------------------
    Case("dtype-fp16", T("precision.dtype=fp16"), ("precision.dtype must be bf16 or fp32, got 'fp16'",)),
    Case("unknown-recipe",
         T("precision.phases=[{precision: bf16}, {precision: fp8, start_step: 10, recipe: fancy}]"),
         ("precision.phases[1].recipe must be one of delayed, current, block, auto, got 'fancy'",)),
    Case("unknown-fallback-recipe",
         T("precision.phases=[{precision: bf16}, {precision: fp8, start_step: 10, fallback: [current, fp4]}]"),
         ("precision.phases[1].fallback must list recipes (delayed, current, block) or bf16, got ['current', 'fp4']",)),
    Case("penalty-action-unknown", T("precision.guard.penalty_action=panic"),
         ("precision.guard.penalty_action must be one of warn, fallback, bf16, got 'panic'",)),
    Case("recipe-auto-without-validation",
         T("precision.phases=[{precision: bf16}, {precision: fp8, start_step: 10, recipe: auto}]",
           "train.eval_interval=0"),
         ("precision.phases: recipe auto chooses by the penalty measured on validation batches: set "
          "train.eval_interval > 0",)),
    Case("phases-out-of-order", T("precision.phases=[{precision: bf16}, {precision: fp8, start_step: 10}, "
                                  "{precision: bf16, start_step: 5}]"),
         ("precision.phases[2].start_step=5 must be after the previous phase's start (10)",)),
    Case("bf16-layers-exceed-layers", T("precision.bf16_first_layers=3", "precision.bf16_last_layers=2"),
         ("precision.bf16_first_layers + bf16_last_layers exceeds the model's 4 layers",)),
    Case("fp8-without-te", T(FP8), ("FP8 phases need Transformer Engine on a CUDA GPU (sm89+); on this machine set "
                                    "precision.emulate_fp8=true",), trains=True),
    # --- DeepSpeed JSON ----------------------------------------------------------------------------------
    Case("ds-config-invalid-json", T("parallel.ds_config={tmp}/bad_ds.json"),
         ("is not valid JSON (Expecting property name enclosed in double quotes at line 1, column 24): fix the "
          "file",)),
    Case("ds-config-optimizer-block", T("parallel.ds_config={tmp}/opt_ds.json"),
         ("has an 'optimizer' block: llmjp-ds passes its own AdamW and LR schedule; remove the block",)),
    Case("ds-config-missing", T("parallel.ds_config={tmp}/nope.json"),
         ("nope.json does not exist: pass an existing file as parallel.ds_config",)),
    # --- data ----------------------------------------------------------------------------------------------
    Case("data-path-missing", T(SMALL, "data.blend=[{tmp}/nope_text_document]"),
         ("nope_text_document.bin", "not found", "pass the prefix of a .bin/.idx pair"), trains=True),
    Case("truncated-bin", T(SMALL, "data.blend=[{tmp}/trunc_bin_text_document]"),
         ("trunc_bin_text_document.bin is 1000 bytes but its .idx needs", "the file is truncated; re-run "
          "`llmjp-ds preprocess`"), trains=True),
    Case("truncated-idx", T(SMALL, "data.blend=[{tmp}/trunc_idx_text_document]"),
         ("trunc_idx_text_document.idx is", "the file is truncated; re-run `llmjp-ds preprocess`"), trains=True),
    Case("wrong-dtype-code", T(SMALL, "data.blend=[{tmp}/badcode_text_document]"),
         ("has unknown dtype code 99 (known: 1-8, uint16=8, int32=4)",), trains=True),
    Case("not-an-index", T(SMALL, "data.blend=[{tmp}/garbage_text_document]"),
         ("is not a Megatron MMIDIDX index",), trains=True),
    Case("vocab-larger-than-embedding", T("model.overrides={vocab_size: 4096}"),
         ("the tokenizer has 8000 pieces but the model's embedding only 4096 rows: set "
          "model.overrides.vocab_size to at least 8000",), trains=True),
    Case("tokenizer-does-not-match-corpus",
         T(SMALL, "data.blend=[{tmp}/bigids_text_document]", "data.tokenizer={tok}"),
         ("contains token id 9000, outside the model's vocabulary of 8000", "re-run `llmjp-ds preprocess` with "
          "this model's tokenizer"), trains=True),
    Case("tokenizer-missing", T(SMALL, "data.blend=[{tmp}/good_text_document]", "data.tokenizer={tmp}/nope"),
         ("data.tokenizer", "does not exist: pass a SentencePiece .model or an HF tokenizer dir"), trains=True),
    # --- run directories and resume ----------------------------------------------------------------------
    Case("latest-names-deleted-tag", T(*TINY, run="{tmp}/dangling"),
         ("dangling/checkpoints/latest names 'step00000030', which is not a complete checkpoint",
          "point latest at one of ['step00000029']"), trains=True),
    Case("resume-with-another-model-shape", T(
        *TINY, "model.overrides={hidden_size: 128, num_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, "
        "ffn_hidden_size: 128}", run="{run}"),
         ("was saved from another model shape (hidden_size 64 saved, 128 now): resume with the run's own model "
          "settings, or set a new run_dir",), trains=True),
    Case("resume-with-another-lm-head", T(*TINY, "precision.fp8_lm_head=true", run="{run}"),
         ("was saved with precision.fp8_lm_head=false (now true): resume with the run's own settings, or set a new "
          "run_dir",),
         trains=True),
    Case("run-dir-is-a-file", T(SMALL, run="{tmp}/a_file"), ("is a file, not a directory; choose another run_dir",),
         trains=True),
    Case("shm-op-build-lock-stale", T(*TINY), ("stale_extensions/deepspeed_shm_comm/lock is left from a build of "
                                               "DeepSpeed's deepspeed_shm_comm op interrupted",  # 120 min or more
                                               "ago, and this run would wait on it forever: if no other run is "
                                               "building it, remove that file and start again"),
         env={"TORCH_EXTENSIONS_DIR": "{tmp}/stale_extensions"}, trains=True),
    # --- export / import ---------------------------------------------------------------------------------
    Case("export-missing-tag", L("export", "--run", "{run}", "--tag", "step00000099", "--output", "{tmp}/hf"),
         ("no complete checkpoint 'step00000099'", "available tags are step00000029, step00000030")),
    Case("export-output-exists", L("export", "--run", "{run}", "--output", "{tmp}/occupied"),
         ("occupied already exists: choose another --output or pass --force to replace it",)),
    Case("export-missing-run", L("export", "--run", "{tmp}/no_run", "--output", "{tmp}/hf"),
         ("no_run does not exist: pass --run the run_dir of a training run",)),
    Case("import-hf-other-architecture", L("import-hf", "--model", "{tmp}/gpt2", "--run", "{tmp}/imported"),
         ("holds a 'gpt2' model (GPT2LMHeadModel), not one of llama (LlamaForCausalLM), qwen3 (Qwen3ForCausalLM), "
          "qwen3_moe (Qwen3MoeForCausalLM): llmjp-ds imports those only",)),
    Case("import-hf-llama-with-biases", L("import-hf", "--model", "{tmp}/llama_bias", "--run", "{tmp}/imported"),
         ("unsupported Llama variant: biases in attention or MLP",)),
    Case("import-hf-broken-config", L("import-hf", "--model", "{tmp}/llama_broken", "--run", "{tmp}/imported"),
         ("config.json is not valid JSON", "the download is incomplete or the file was edited")),
    Case("import-hf-missing-model", L("import-hf", "--model", "{tmp}/no_model", "--run", "{tmp}/imported"),
         ("no_model does not exist: pass --model the directory save_pretrained wrote",)),
    Case("import-hf-unknown-preset", L("import-hf", "--model", "{tmp}/llama", "--run", "{tmp}/imported",
                                       "--preset", "llmjp3-7b"),
         ("unknown run preset 'llmjp3-7b' (did you mean 'llmjp3-3.7b'?)",)),
    Case("import-hf-run-exists", L("import-hf", "--model", "{tmp}/llama", "--run", "{tmp}/has_run"),
         ("has_run already holds a run: choose another --run or pass --force",)),
    # --- preprocess --------------------------------------------------------------------------------------
    Case("preprocess-output-exists", L("preprocess", "--input", "{tmp}/docs.jsonl", "--tokenizer", "{tok}",
                                       "--output-prefix", "{tmp}/good"),
         ("good_text_document.bin already exists: choose another --output-prefix, or pass --force to replace it",)),
    Case("preprocess-input-missing", L("preprocess", "--input", "{tmp}/nope.jsonl", "--tokenizer", "{tok}",
                                       "--output-prefix", "{tmp}/new"),
         ("nope.jsonl not found: check the path",)),
    Case("preprocess-bad-json-line", L("preprocess", "--input", "{tmp}/bad.jsonl", "--tokenizer", "{tok}",
                                       "--output-prefix", "{tmp}/new"),
         ("bad.jsonl:2: invalid JSON", "or pass --skip-bad to skip such lines")),
    Case("preprocess-tokenizer-missing", L("preprocess", "--input", "{tmp}/docs.jsonl", "--tokenizer",
                                           "{tmp}/no_tok", "--output-prefix", "{tmp}/new"),
         ("no_tok not found: pass a SentencePiece .model file or a directory holding tokenizer.model",)),
    # --- hostfiles (the deepspeed launcher owns --hostfile: `llmjp-ds preflight` checks it first) ----------
    Case("hostfile-missing", L("preflight", "--hostfile", "{tmp}/no_hosts"),
         ("no_hosts does not exist", "the deepspeed launcher would silently start every rank on this machine")),
    Case("hostfile-malformed", L("preflight", "--hostfile", "{tmp}/hosts_bad"),
         ("hosts_bad:3: 'node-b slot=8' is not '<hostname> slots=<N>': fix or comment out that line",)),
    Case("hostfile-duplicate-host", L("preflight", "--hostfile", "{tmp}/hosts_dup"),
         ("hosts_dup:2: host node-a is listed twice",)),
    Case("hostfile-world-size", L("preflight", "--hostfile", "hostfiles/h100", "--num-nodes", "3", "--preset",
                                  "llmjp3-172b"),
         ("world size 24 is not divisible by tensor_parallel x pipeline_stages = 4 x 16: launch a multiple of 64 "
          "ranks",)),
    Case("preflight-disk-speed-not-positive", L("preflight", "--hostfile", "hostfiles/h100", "--disk-gbps", "0"),
         ("--disk-gbps 0.0: give a positive number",)),
]

TOPICS = (cases_data, cases_config, cases_checkpoint, cases_cluster, cases_from_megatron)
ALL_CASES = CASES + [case for topic in TOPICS for case in topic.CASES]


class Ctx:
    """Inputs of the catalogue, made once: corpora good and broken, config files, HF dirs, hostfiles."""

    def __init__(self, tmp: Path, tok: Path, run: Path):
        import numpy as np

        from llmjp_ds.data.indexed import IndexedDatasetWriter

        self.tmp, self.tok, self.run = tmp, tok, run
        good = cases_data.good_corpus(tmp, tok)
        for name, edit in (("trunc_bin", lambda b, i: (b[:1000], i)), ("trunc_idx", lambda b, i: (b, i[:-100])),
                           ("badcode", lambda b, i: (b, i[:17] + bytes([99]) + i[18:])),
                           ("garbage", lambda b, i: (b, b"not an index at all" + i[19:]))):
            b, i = edit(Path(f"{good}.bin").read_bytes(), Path(f"{good}.idx").read_bytes())
            Path(f"{tmp}/{name}_text_document.bin").write_bytes(b)
            Path(f"{tmp}/{name}_text_document.idx").write_bytes(i)
        with IndexedDatasetWriter(tmp / "bigids_text_document", np.uint16) as w:  # ids of a bigger vocabulary
            for d in range(300):
                w.add_document(np.array([1, 5 + d % 50, 9000, 7000, 2] * 20))
        (tmp / "typo.yaml").write_text("optimm:\n  lr: 1.0e-4\n")
        (tmp / "broken.yaml").write_text("train: {steps: 3\n")
        (tmp / "list.yaml").write_text("- steps: 3\n- lr: 1\n")
        (tmp / "bad_ds.json").write_text('{"train_batch_size": 8,}')
        (tmp / "opt_ds.json").write_text(json.dumps({"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}))
        (tmp / "bad.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
        (tmp / "a_file").write_text("not a directory")
        (tmp / "occupied").mkdir()
        (tmp / "occupied" / "keep.txt").write_text("precious")
        (tmp / "gpt2").mkdir()
        (tmp / "gpt2" / "config.json").write_text(json.dumps({
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
            "vocab_size": 1000}))
        llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "intermediate_size": 128, "vocab_size": 1000}
        for name, extra in (("llama", {}), ("llama_bias", {"attention_bias": True})):
            (tmp / name).mkdir()
            (tmp / name / "config.json").write_text(json.dumps({**llama, **extra}))
        (tmp / "llama_broken").mkdir()
        (tmp / "llama_broken" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_')
        (tmp / "has_run").mkdir()
        (tmp / "has_run" / "config.yaml").write_text("run_dir: has_run\n")
        (tmp / "hosts_bad").write_text("# two nodes\nnode-a slots=8\nnode-b slot=8\n")
        (tmp / "hosts_dup").write_text("node-a slots=8\nnode-a slots=4\n")
        lock = tmp / "stale_extensions" / "deepspeed_shm_comm" / "lock"  # a build interrupted two hours ago
        lock.parent.mkdir(parents=True)
        lock.touch()
        os.utime(lock, (time.time() - 7200, time.time() - 7200))
        # a run whose latest names a tag that was deleted: the baseline's checkpoints, step 30 removed
        dangling = tmp / "dangling"
        shutil.copytree(run, dangling, ignore=shutil.ignore_patterns("step00000030"))
        self.dangling = dangling
        for topic in TOPICS:
            topic.prepare(self)


@pytest.fixture(scope="module")
def ctx(bundled, baseline, tmp_path_factory):
    return Ctx(tmp_path_factory.mktemp("bad"), bundled[1], baseline[0])


# what every training start rewrites in its run directory, holding no data: the shared-directory token
# (parallel/context.py) and the owner's record in the lock file (checkpoint/lock.py)
BOOKKEEPING = (".llmjp_ds_shared", ".llmjp_ds.lock")


def _files(*roots) -> dict[str, str]:
    """sha256 of every file under ``roots``: existing data must come out of a failed command unchanged."""
    import hashlib

    out = {}
    for root in map(Path, roots):
        for p in [root] if root.is_file() else root.rglob("*") if root.is_dir() else []:
            if p.is_file() and p.name not in BOOKKEEPING:
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def check_one_line_error(result: subprocess.CompletedProcess, expect, took: float, trains: bool) -> str:
    out = result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0, out[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), f"stderr is not one error line:\n{result.stderr}"
    assert "Traceback" not in out, out[-3000:]
    for fragment in expect:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    if trains:  # DeepSpeed's marks in its own output (the error line may name its shm op)
        logged = out.replace(lines[0], "")
        assert not any(m in logged for m in DEEPSPEED_STARTED), f"DeepSpeed had started:\n{out[-2000:]}"
        assert took < SECONDS, f"took {took:.1f}s"
    return lines[0]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_catalogue_of_bad_inputs(ctx, tmp_path):
    """All cases in one test (one fixture setup, and one report naming every case that failed)."""
    record = os.environ.get("LLMJP_DS_ERRORS_RECORD")  # write id -> message (to regenerate docs/errors.md)
    messages, failures, times = {}, [], {}
    import torch

    cuda = torch.cuda.is_available()
    protected = [ctx.tmp, ctx.run]
    before = _files(*protected)

    def one(case):
        argv = case.argv(ctx)
        t0 = time.monotonic()
        result = run([sys.executable, *argv], env=subprocess_env(**{k: sub(v, ctx) for k, v in case.env.items()}),
                     timeout=120, cwd=sub(case.cwd, ctx) if case.cwd else REPO)
        took = times[case.id] = time.monotonic() - t0
        try:
            messages[case.id] = check_one_line_error(result, case.expect, took, not case.after_start and (
                case.trains or "llmjp_ds.train" in argv))
        except AssertionError as exc:
            failures.append(f"{case.id}: {exc}")

    # a GPU machine with TE runs FP8: there the sm89 check is what fails (unit-tested in tests/precision)
    cases = [c for c in ALL_CASES if not (c.id == "fp8-without-te" and cuda)]
    only = os.environ.get("LLMJP_DS_TEST_CASES")  # a comma-separated subset of ids (to work on some cases)
    if only:
        cases = [c for c in cases if c.id in only.split(",")]
    # two at a time: each case is mostly interpreter start-up and imports, single-threaded
    with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
        list(pool.map(one, cases))
    if record:
        Path(record).write_text(json.dumps({"tmp": str(ctx.tmp), "run": str(ctx.run), "messages": messages,
                                            "seconds": times},
                                           indent=1, ensure_ascii=False))
    assert not failures, "\n\n".join(failures)
    after = _files(*protected)
    changed = [p for p in before if after.get(p) != before[p]]
    assert not changed, f"existing files changed or removed: {changed}"
    assert not list(ctx.tmp.glob("run-new*")) and not (ctx.tmp / "imported").exists() and \
        not (ctx.tmp / "hf").exists() and not list(ctx.tmp.glob("new_text_document*")) and \
        not (ctx.tmp / "converted.yaml").exists()
    assert len(ALL_CASES) >= 100 or only


def test_every_case_has_a_row_in_docs():
    text = DOCS.read_text()
    ids = [c.id for c in ALL_CASES]
    assert len(ids) == len(set(ids)), "case ids repeat"
    missing = [c.id for c in ALL_CASES if f"`{c.id}`" not in text]
    assert not missing, f"docs/errors.md lacks rows for {missing}"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_debug_shows_the_traceback(tmp_path):
    argv = [sys.executable, "-m", "llmjp_ds.train", "--debug", "--set", f"run_dir={tmp_path}/r",
            "--set", "train.global_batch_size=7", "--set", "train.micro_batch_size=2"]
    result = run(argv)
    assert result.returncode != 0
    assert "Traceback (most recent call last)" in result.stderr and "UserError: train.global_batch_size=7" in \
        result.stderr
    no_debug = run([a for a in argv if a != "--debug"], env=subprocess_env(LLMJP_DS_DEBUG="1"))
    assert "Traceback" in no_debug.stderr  # the environment variable does the same


# --- the two that need a filesystem of their own --------------------------------------------------------

def _mount_tmpfs(path: Path, options: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None or os.environ.get("LLMJP_DS_TEST_NO_MOUNT"):
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def _umount(path: Path) -> None:
    subprocess.run(["umount", str(path)], capture_output=True)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_read_only_run_directory(baseline, tmp_path):
    """Resuming into a run directory that cannot be written (a read-only mount: root ignores chmod)."""
    ro = tmp_path / "ro"
    if _mount_tmpfs(ro, "size=64m"):
        shutil.copytree(baseline[0], ro / "run")
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        cleanup = lambda: _umount(ro)  # noqa: E731
    elif os.geteuid() != 0:
        shutil.copytree(baseline[0], ro / "run")
        for p in [ro / "run", *(ro / "run").rglob("*")]:
            if p.is_dir():
                p.chmod(0o555)
        cleanup = lambda: [p.chmod(0o755) for p in [ro / "run", *(ro / "run").rglob("*")] if p.is_dir()]  # noqa
    else:
        pytest.skip("root without mount(8): no way to make a directory read-only for root")
    try:
        before = _files(ro)
        t0 = time.monotonic()
        result = run(train_argv(ro / "run", [*TINY, "train.steps=40", "checkpoint.interval=1"]))
        line = check_one_line_error(result, ("run_dir", "is not writable", "choose another run_dir or fix its "
                                             "permissions or mount"), time.monotonic() - t0, trains=True)
        assert _files(ro) == before
        print(line)
    finally:
        cleanup()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_full_disk_during_a_save(baseline, tmp_path):
    """The disk fills while DeepSpeed writes a checkpoint: one line, exit non-zero, the partial checkpoint removed,
    latest still names the previous complete checkpoint (and it still loads). A tmpfs just too small for one more
    checkpoint gives a real ENOSPC; without mount rights RLIMIT_FSIZE makes the big write fail (EFBIG)."""
    src = baseline[0]
    used = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    one_ckpt = sum(p.stat().st_size for p in (src / "checkpoints" / "step00000030").iterdir())
    disk = tmp_path / "disk"
    mounted = _mount_tmpfs(disk, f"size={-(-(used + one_ckpt // 2) // 2**20)}m")
    run_dir = disk / "run"
    shutil.copytree(src, run_dir)
    limit = None if mounted else (lambda: (signal.signal(signal.SIGXFSZ, signal.SIG_IGN),
                                           resource.setrlimit(resource.RLIMIT_FSIZE, (one_ckpt // 2,) * 2)))
    try:
        t0 = time.monotonic()
        # the synchronous save (a background write's failure: test_multi_rank_failures.py, both modes)
        result = subprocess.run([*train_argv(run_dir, [*TINY, "train.steps=32", "checkpoint.interval=1",
                                                       "checkpoint.keep_last=2", "checkpoint.async_save=false"])],
                                capture_output=True, text=True, timeout=150, env=subprocess_env(), cwd=REPO,
                                preexec_fn=limit)
        line = check_one_line_error(result, ("saving checkpoint step00000031", "failed (", "is the disk full? Free "
                                             "space or lower checkpoint.keep_last, then resume; latest still names "
                                             "the complete checkpoint step00000030"), 0, trains=False)
        assert time.monotonic() - t0 < 150
        assert latest_of(run_dir) == "step00000030" and assert_latest_complete(run_dir)
        assert not (run_dir / "checkpoints" / "step00000031").exists()
        print(("tmpfs ENOSPC: " if mounted else "RLIMIT_FSIZE: ") + line)
        # once there is room again, the run resumes from that checkpoint
        if mounted:
            subprocess.run(["mount", "-o", f"remount,size={-(-(used + 3 * one_ckpt) // 2**20)}m", str(disk)],
                           check=True)
        check_ok(run(train_argv(run_dir, [*TINY, "train.steps=32", "checkpoint.interval=1"])))
        assert latest_of(run_dir) == "step00000032"
    finally:
        if mounted:
            _umount(disk)


def test_fp8_on_a_gpu_before_sm89(monkeypatch):
    """FP8 phases with Transformer Engine on a GPU that cannot run FP8 (A100, sm80): not reproducible on a
    CPU-only machine through the CLI, so the schedule's check is called as the trainer calls it, before any
    process group, with the hardware probe answering 'no'."""
    from llmjp_ds.precision import schedule as precision
    from llmjp_ds.config import load_config
    from llmjp_ds.errors import UserError

    monkeypatch.setattr(precision, "fp8_hardware_available", lambda: False)
    cfg = load_config(None, ["precision.phases=[{precision: bf16}, {precision: fp8, start_step: 5}]"])
    with pytest.raises(UserError) as info:
        precision.PrecisionSchedule(cfg.precision, "te", 1024)
    message = str(info.value)
    assert "\n" not in message and message.startswith("FP8 phases need an sm89+ GPU (Ada, Hopper or newer)")
    assert "set precision.emulate_fp8=true to emulate, or remove the fp8 phases" in message
