"""Bad inputs of the catalogue, config: every numeric and path field, stop signals, config files."""

from __future__ import annotations

import json
from pathlib import Path

from tests.reliability.cases import Case, L, T  # noqa: F401

# a setting validate_run refuses later than run_dir: should the run_dir check ever let one of these through, the
# case fails on the other message instead of training into /, the home or the repository
LATER = ("train.global_batch_size=7", "train.micro_batch_size=2")


def F(name: str, *sets: str, preset: str | None = None):
    """``python -m llmjp_ds.train --config {tmp}/config/<name>`` (after T's fresh run_dir and ``sets``)."""
    def argv(c):
        return [*T(*sets)(c), "--config", str(c.tmp / "config" / name), *(["--preset", preset] if preset else [])]
    return argv


# expert parallelism's refusals: an MoE shape, batches every world size below divides
EP = ("model.shape=tiny-moe", "train.micro_batch_size=1", "train.global_batch_size=12")

CASES: list[Case] = [
    # --- Megatron-LM's arguments as keys: one way to say each, and only what the model computes ---------------
    Case("min-lr-and-its-ratio", T("optim.min_lr=0", "optim.min_lr_ratio=0"),
         ("optim.min_lr=0 and optim.min_lr_ratio=0 both give the LR the decay ends at: keep one and set the other to "
          "null",)),
    Case("dropout-not-zero", T("model.hidden_dropout=0.1"),
         ("model.hidden_dropout must be 0 (llmjp-ds's layers apply no dropout; LLM-jp trains without it, Megatron's "
          "--attention-dropout 0.0 --hidden-dropout 0.0), got 0.1: set it to 0",)),
    Case("distributed-timeout-zero", T("parallel.distributed_timeout_s=0"),
         ("parallel.distributed_timeout_s must be > 0 (seconds a collective may wait for every rank), got 0",)),
    Case("init-from-hf-and-from-a-checkpoint", T("model.init_from_hf={tmp}/llama", "model.init_from_checkpoint={run}"),
         ("model.init_from_hf and model.init_from_checkpoint both give the first weights: keep one",)),
    # --- numbers: each field's declared range, and no NaN / infinity -------------------------------------
    Case("optim-beta-out-of-range", T("optim.beta1=1.5"),
         ("optim.beta1 must be in [0, 1) (AdamW's moment decay), got 1.5",)),
    Case("optim-eps-negative", T("optim.eps=-1"), ("optim.eps must be > 0 (AdamW's denominator term), got -1",)),
    Case("lr-nan-in-file", F("nan_lr.yaml"),
         ("optim.lr must be a finite number, got nan: NaN and infinity are not settings; set a number > 0",)),
    Case("lr-infinity-in-json", F("inf_lr.json"), ("optim.lr must be a finite number, got inf",)),
    Case("split-nan", T("data.split=[.nan, 0.01]"), ("data.split[0] must be a finite number, got nan",)),
    Case("decay-steps-zero", T("optim.decay_steps=0"), ("optim.decay_steps must be >= 1, got 0",)),
    Case("train-seed-negative", T("train.seed=-1"),
         ("train.seed must be in [0, 4294967295] (numpy seeds are 32-bit), got -1",)),
    Case("guard-factor-not-above-one", T("precision.guard.factor=0.5"),
         ("precision.guard.factor must be > 1 (a loss above factor x its running mean is diverging), got 0.5",)),
    Case("phase-margin-negative", T("precision.phases=[{margin: -1}]"),
         ("precision.phases[0].margin must be >= 0",)),
    Case("model-override-float-not-positive", T("model.overrides={rope_theta: -1.0}"),
         ("model.overrides.rope_theta must be a positive float, got -1.0",)),
    Case("blend-weight-negative", T("data.blend=[-1, {tmp}/good_text_document]"),
         ("data.blend[0] must be >= 0 (a corpus weight), got -1",)),
    Case("data-order-unknown", T("data.order=megatorn"),
         ("data.order must be llmjp or megatron (the sample order), got 'megatorn' (did you mean 'megatron'?)",)),
    Case("split-four-shares", T("data.split=[90, 5, 3, 2]"),
         ("data.split must be [train, valid] or [train, valid, test] shares with train > 0 (Megatron's --split "
          "99990,8,2 is [99990, 8, 2]), got [90, 5, 3, 2]",)),
    Case("validation-without-valid-share", T("data.split=[1, 0]", "train.eval_interval=5"),
         ("train.eval_interval=5 validates on the valid split, but data.split [1, 0] gives it no share",
          "or set train.eval_interval=0")),
    # --- stop signals: names of signals a handler can catch; the relaunch's wait ----------------------------
    Case("stop-signals-unknown", T("checkpoint.stop_signals=[SIGTERM, SIGUSR3]"),
         ("checkpoint.stop_signals[1] 'SIGUSR3' is not a signal name (did you mean 'SIGUSR2'?)",)),
    Case("stop-signals-uncatchable", T("checkpoint.stop_signals=[SIGTERM, KILL]"),
         ("checkpoint.stop_signals[1] 'KILL': SIGKILL cannot be caught", "use SIGTERM, SIGINT, SIGUSR1 or SIGUSR2")),
    Case("stop-signals-empty", T("checkpoint.stop_signals=[]"),
         ("checkpoint.stop_signals is empty", "list at least SIGTERM")),
    # --- keep rules (log-spaced checkpoints): in order of increasing below ---------------------------------
    Case("keep-rules-below-not-increasing", T("checkpoint.keep=[{below: 100, every: 10}, {below: 10, every: 1}]"),
         ("checkpoint.keep[1].below must be above checkpoint.keep[0].below (100), got 10",
          "list the rules by increasing below")),
    Case("wait-for-run-dir-negative", lambda c: [*T()(c), "--wait-for-run-dir", "-5"],
         ("--wait-for-run-dir -5.0: give the seconds to wait for the run directory, 0 or more",)),
    # --- run_dir: a directory of its own -----------------------------------------------------------------
    Case("run-dir-empty", T(*LATER, run=""), ("run_dir is empty (''): give the run a directory of its own",)),
    Case("run-dir-root", T(*LATER, run="/"), ("run_dir / is the filesystem root", "give it a directory of its own")),
    Case("run-dir-home", T(*LATER, run=str(Path.home())), ("is your home directory", "give it a directory of its "
                                                           "own, e.g. runs/my-run")),
    Case("run-dir-current-directory", T(*LATER, run="."),
         ("run_dir . is the current directory", "give it a directory of its own")),
    # from a directory of the catalogue's own: whatever holds the checkout (the home, /tmp) is not what `..` is
    Case("run-dir-holds-current-directory", T(*LATER, run=".."),
         ("run_dir .. holds the current directory (", "cwd/inner): a run writes checkpoints/",
          "give it a directory of its own"), cwd="{tmp}/cwd/inner"),
    # --- health: settings under which no verdict can ever be reached ---------------------------------------
    Case("health-window-below-min-history", T("health.window=10", "health.min_history=20"),
         ("health.window=10 holds fewer values than health.min_history=20 asks for before any verdict: no loss or "
          "grad-norm spike would ever be judged; set health.window to at least 20",)),
    Case("health-action-after-the-run", T("health.loss.action=stop", "train.steps=20"),
         ("health.loss.action=stop can never act: a spike is judged from step 21 (after health.min_history=20 steps "
          "of history), and train.steps=20",)),
    Case("health-valid-loss-without-validations", T("health.valid_loss.action=rollback", "train.eval_interval=0"),
         ("health.valid_loss.action=rollback can never act: a validation jump is judged against 3 earlier "
          "validations, and the run validates 0 times (train.eval_interval=0",)),
    # --- path fields ---------------------------------------------------------------------------------------
    Case("tokenizer-missing-without-blend", T("data.tokenizer={tmp}/config/no_tokenizer"),
         ("no_tokenizer does not exist: pass a SentencePiece .model or an HF tokenizer dir",)),
    Case("tokenizer-without-blend", T("data.tokenizer={tok}"),
         ("is set but data.blend is empty", "or unset data.tokenizer")),
    Case("init-from-hf-missing", T("model.init_from_hf={tmp}/config/no_hf"),
         ("no_hf does not exist: pass the directory save_pretrained wrote",)),
    Case("init-from-hf-not-a-model-dir", T("model.init_from_hf={tmp}/config"),
         ("has no config.json: pass the directory save_pretrained wrote",)),
    Case("cache-dir-under-a-file", T("data.cache_dir={tmp}/config/a_file/cache"),
         ("a_file is a file, not a directory; choose another data.cache_dir",)),
    Case("ds-config-empty-path", T("parallel.ds_config="),
         ("parallel.ds_config is empty (''): set a path, or leave it unset (null)",)),
    # --- config files ------------------------------------------------------------------------------------
    Case("duplicate-key-yaml", F("dup_key.yaml"),
         ("dup_key.yaml: key 'optim.lr' is given twice, at lines 2 and 4", "keep one")),
    Case("duplicate-key-in-phase", F("dup_phase.yaml"),
         ("key 'precision.phases[1].start_step' is given twice, at lines 5 and 7",)),
    Case("duplicate-key-json", F("dup_key.json"), ("dup_key.json: key 'optim.lr' is given twice, at lines 1 and 3",)),
    Case("config-file-empty", F("empty.yaml"), ("empty.yaml is empty (no settings, only blank lines or comments)",)),
    Case("config-file-bom", F("bom.yaml"), ("bom.yaml starts with a byte-order mark (BOM): save it as UTF-8 without "
                                            "a BOM",)),
    Case("config-file-python-tag", F("python_tag.yaml"),
         ("the YAML tag !!python/object/apply:os.system at line 1 is not allowed", "remove the tag")),
    Case("config-key-not-a-string", F("int_key.yaml"), ("line 2: the key 1 in train is a YAML int, not a name",)),
    Case("unknown-preset-in-file", F("bad_preset.yaml"),
         ("unknown run preset 'llmjp3-7b' named in", "bad_preset.yaml (did you mean 'llmjp3-3.7b'?)")),
    Case("preset-in-file-not-a-name", F("list_preset.yaml"), ("preset must name a run preset", "got ['demo']")),
    Case("preset-disagrees-with-file", F("demo_preset.yaml", preset="llmjp3-1.8b"),
         ("--preset llmjp3-1.8b and the preset: demo of config file", "disagree: keep one")),
    Case("set-key-empty-segment", T("optim..lr=1"),
         ("--set 'optim..lr=1': the key 'optim..lr' has an empty name between its dots",)),
    Case("set-list-item-wrong-type", T("data.split=[a, b]"), ("config key 'data.split[0]' must be float",)),
    Case("set-phase-list-item-wrong-type", T("precision.phases=[{candidates: [delayed, 2]}]"),
         ("config key 'precision.phases[0].candidates[1]' must be str",)),
    Case("set-mapping-key-not-a-string", T("model.overrides={1: 2}"),
         ("config key 1 in model.overrides is not a name (it is int)",)),
    # --- expert parallelism (docs/moe.md) ----------------------------------------------------------------
    Case("ep-dense-model", T("parallel.expert_parallel=2", *EP[1:]),
         ("parallel.expert_parallel=2 splits an MoE model's experts, but model.shape tiny is dense (no experts)",
          "set parallel.expert_parallel=1, or train an MoE shape"), env={"WORLD_SIZE": "2"}),
    Case("ep-experts-not-divisible", T("parallel.expert_parallel=3", *EP),
         ("the model's 8 experts are not divisible by parallel.expert_parallel=3",
          "choose an expert_parallel that divides 8 (2, 4, 8)"), env={"WORLD_SIZE": "3"}),
    Case("ep-data-parallel-not-divisible", T("parallel.expert_parallel=4", *EP),
         ("parallel.expert_parallel=4 does not divide the data-parallel size 2",), env={"WORLD_SIZE": "2"}),
    Case("ep-zero0", T("parallel.expert_parallel=2", "parallel.zero_stage=0", *EP),
         ("parallel.expert_parallel=2 needs ZeRO-1 or ZeRO-2, not ZeRO-0", "use parallel.zero_stage=1 or 2"),
         env={"WORLD_SIZE": "2"}),
    Case("ep-zero3", T("parallel.expert_parallel=2", "parallel.zero_stage=3", *EP),
         ("parallel.expert_parallel=2 needs ZeRO-1 or ZeRO-2, not ZeRO-3: DeepSpeed refuses its MoE with ZeRO-3",),
         env={"WORLD_SIZE": "2"}),
    Case("ep-zero2-without-contiguous-gradients",
         T("parallel.expert_parallel=2", "parallel.zero_stage=2", "parallel.ds_config={tmp}/config/zero2_split.json",
           *EP),
         ("DeepSpeed's ZeRO-2 reduces the expert gradients of an MoE model only with contiguous_gradients and "
          "reduce_scatter",), env={"WORLD_SIZE": "2"}),
    Case("recompute-moe-on-a-dense-model", T("model.recompute=moe"),
         ("model.recompute=moe recomputes the MoE blocks, and model.shape tiny has no experts",
          "use model.recompute=selective (the attention core) or full (whole layers)")),
    Case("moe-with-tensor-parallel", T("parallel.tensor_parallel=2", *EP),
         ("model.shape tiny-moe has experts and parallel.tensor_parallel=2",
          "use parallel.tensor_parallel=1 and split the experts with parallel.expert_parallel"),
         env={"WORLD_SIZE": "2"}),
]


def prepare(ctx) -> None:
    """Write this topic's inputs under ``ctx.tmp``."""
    d = ctx.tmp / "config"
    d.mkdir()
    (ctx.tmp / "cwd" / "inner").mkdir(parents=True)  # the working directory of run-dir-holds-current-directory
    (d / "nan_lr.yaml").write_text("optim:\n  lr: .nan\n")
    (d / "inf_lr.json").write_text('{"optim": {"lr": Infinity}}\n')
    (d / "dup_key.yaml").write_text("optim:\n  lr: 1.0e-4\n  beta1: 0.9\n  lr: 3.0e-4\n")
    (d / "dup_phase.yaml").write_text("precision:\n  phases:\n    - precision: bf16\n    - precision: fp8\n"
                                      "      start_step: 10\n      recipe: delayed\n      start_step: 20\n")
    (d / "dup_key.json").write_text('{"optim": {"lr": 1e-4,\n  "beta1": 0.9,\n  "lr": 3e-4}}\n')
    (d / "empty.yaml").write_text("")
    (d / "bom.yaml").write_bytes(b"\xef\xbb\xbftrain:\n  steps: 3\n")
    (d / "python_tag.yaml").write_text("run_name: !!python/object/apply:os.system [echo hi]\n")
    (d / "int_key.yaml").write_text("train:\n  1: 3\n")
    (d / "bad_preset.yaml").write_text("preset: llmjp3-7b\n")
    (d / "list_preset.yaml").write_text("preset: [demo]\n")
    (d / "demo_preset.yaml").write_text(json.dumps({"preset": "demo"}))
    (d / "zero2_split.json").write_text(json.dumps({"zero_optimization": {"stage": 2, "contiguous_gradients": False}}))
    (d / "a_file").write_text("not a directory")
