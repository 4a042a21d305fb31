"""Bad inputs of the catalogue, checkpoints: resume, export, import, run directories.

Each case works on a copy of the baseline run (``{tmp}/checkpoint/<name>``: checkpoints step00000029 and
step00000030, both with a manifest) altered as a careless command, a crash or an attacker would. Planted pickles
append to ``canary.txt``, a file the harness checksums: a payload that ran changes it. Where a planted file's
manifest entry is rewritten too (an attacker who can write the file can write the manifest), the safe reader is
what refuses it; where it is not, the resume passes over the tag as damaged (tests/reliability/test_run_dir.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from tests.reliability.cases import Case, L, T
from tests.reliability.conftest import TINY

R = "{tmp}/checkpoint"
SYSTEM = f"{os.system.__module__}.system"
MODEL = "mp_rank_00_model_states.pt"
OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def resume(name: str, *sets: str):
    return T(*TINY, "train.steps=32", *sets, run=f"{R}/{name}")


MEGATRON_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron"
# the run config of the fixtures' model (tests/fixtures/megatron/make_fixtures.py)
MEGATRON_SETS = ("model.overrides={hidden_size: 32, num_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, "
                 "ffn_hidden_size: 64, vocab_size: 256, seq_len: 32}", "data.seq_len=32",
                 "train.global_batch_size=8", "train.micro_batch_size=8")


def megatron(load: str, *sets: str, run: str = f"{R}/mg_new"):
    args = ["import-megatron", "--load", load, "--run", run, "--preset", "demo"]
    for value in (*MEGATRON_SETS, *sets):
        args += ["--set", value]
    return L(*args)


CASES: list[Case] = [
    # --- a fine-tune start's source (model.init_from_checkpoint), checked before any process group (each its own
    # run_dir: both take its lock, and the refusal leaves no directory) ------------------------------------------
    Case("finetune-source-of-another-shape",
         T(*TINY, "model.overrides={hidden_size: 128, num_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, "
           "ffn_hidden_size: 128}", "model.init_from_checkpoint={run}", run="{tmp}/run-new-finetune-1"),
         ("model.init_from_checkpoint: checkpoint step00000030 of ", "was saved from another model shape (hidden_size "
          "64 saved, 128 now): give the run that model's settings, or start from a checkpoint of this shape"),
         trains=True),
    Case("finetune-source-not-a-run",
         T(*TINY, "model.init_from_checkpoint={tmp}/config", run="{tmp}/run-new-finetune-2"),
         ("config is neither a run directory (with checkpoints/) nor one of its checkpoints: pass a run directory, or "
          "RUN/checkpoints/stepNNNNNNNN",), trains=True),
    # --- code planted in a file that resume reads (its manifest entry rewritten to match) --------------------
    Case("resume-planted-pickle-model-states", resume("planted_model"),
         (f"{MODEL} holds {SYSTEM}, which loading would have to execute", "weights_only=True"), after_start=True),
    Case("resume-planted-pickle-optimizer-states", resume("planted_optim"),
         (f"{OPTIM} holds {SYSTEM}, which loading would have to execute",), after_start=True),
    Case("resume-planted-pickle-extra-state", resume("planted_extra"),
         (f"{MODEL} holds {SYSTEM} in ", "_extra_state, which loading would have to execute"), after_start=True),
    Case("resume-planted-pickle-exec", resume("planted_exec"),
         (f"{MODEL} holds builtins.exec, which loading would have to execute",), after_start=True),
    # --- background checkpoints whose snapshots the node cannot hold (the launcher's ranks per node) -----------
    Case("async-save-host-memory", T(*TINY, "train.steps=2", run=f"{R}/host_memory"),
         ("checkpoint.async_save needs ~", "GiB of host memory on this node for its snapshots (100000 ranks)",
          "set checkpoint.async_save=false"), env={"LOCAL_SIZE": "100000"}, after_start=True),
    # --- paths that lead out of the run ----------------------------------------------------------------------
    Case("resume-latest-points-outside", resume("latest_outside"),
         ("checkpoints/latest names '../../elsewhere/checkpoints/step00000030', which is not a checkpoint tag of",
          "tags look like step00000100, never a path"), trains=True),
    Case("resume-tag-is-a-symlink", resume("tag_symlink"),
         ("step00000030 is a symbolic link (to", "reads only checkpoints inside the run's checkpoints/"),
         trains=True),
    Case("resume-file-is-a-symlink", resume("file_symlink"),
         (f"{MODEL} is a symbolic link (to", "reads only the files inside a checkpoint's own directory"),
         after_start=True),
    # --- damage everywhere -------------------------------------------------------------------------------------
    Case("resume-no-intact-checkpoint", resume("all_damaged"),
         ("no intact checkpoint in", f"step00000030: {MODEL} is 0 bytes, the manifest says",
          "step00000029: its marker is not valid", "Restore the files from a copy, or set a new run_dir"),
         after_start=True),
    Case("resume-checkpoint-without-manifest", resume("no_manifest"),
         ("no intact checkpoint in", "it has no manifest (written by an earlier release of llmjp-ds)"),
         after_start=True),
    Case("latest-unreadable", resume("latest_binary"), ("checkpoints/latest cannot be read",), trains=True),
    # --- settings that cannot change on resume -----------------------------------------------------------------
    Case("resume-with-another-dtype", resume("other_dtype", "precision.dtype=bf16"),
         ('was saved with precision.dtype="fp32" (now "bf16"): resume with the run\'s own settings',),
         trains=True),
    Case("resume-with-another-seq-len", resume("other_seq_len", "data.seq_len=16"),
         ('was saved with data.seq_len=32 (now 16): resume with the run\'s own settings',), trains=True),
    Case("resume-with-another-zero-stage", resume("other_zero_stage", "parallel.zero_stage=2"),
         ("was saved on PP1 x DP1 with ZeRO-1; resuming it on PP1 x DP1 (ZeRO-2) works with ZeRO-1 on both sides "
          "only", "parallel.zero_stage=1"), trains=True),
    # --- export ------------------------------------------------------------------------------------------------
    Case("export-force-onto-its-run", L("export", "--run", f"{R}/base", "--output", f"{R}/base", "--force"),
         ("--output", "is the run", "that the export reads: choose an --output outside its checkpoints")),
    Case("export-force-onto-the-run-parent", L("export", "--run", f"{R}/base", "--output", R, "--force"),
         ("holds the run", "that the export reads")),
    Case("export-force-onto-a-checkpoint", L("export", "--run", f"{R}/base", "--output",
                                             f"{R}/base/checkpoints/step00000030", "--force"),
         ("lies inside the run", "that the export reads")),
    Case("export-force-onto-another-run", L("export", "--run", f"{R}/base", "--output", f"{R}/planted_model",
                                            "--force"),
         ("planted_model is not an earlier export of llmjp-ds (no llmjp_ds_export.json, and it holds a run)",
          "--force replaces only earlier exports")),
    Case("export-force-onto-a-plain-directory", L("export", "--run", f"{R}/base", "--output", f"{R}/precious",
                                                  "--force"),
         ("precious is not an earlier export of llmjp-ds (no llmjp_ds_export.json)",)),
    Case("export-tag-outside-the-run", L("export", "--run", f"{R}/base", "--tag",
                                         "../../latest_outside/checkpoints/step00000030", "--output", f"{R}/hf_new"),
         ("--tag names '../../latest_outside/checkpoints/step00000030', which is not a checkpoint tag of",)),
    Case("export-tag-is-a-symlink", L("export", "--run", f"{R}/tag_symlink", "--tag", "step00000030",
                                      "--output", f"{R}/hf_new"),
         ("step00000030 is a symbolic link (to",)),
    Case("export-damaged-tag", L("export", "--run", f"{R}/all_damaged", "--tag", "step00000030", "--output",
                                 f"{R}/hf_new"),
         ("checkpoint step00000030 of", f"is damaged ({MODEL} is 0 bytes, the manifest says",
          "export another tag, e.g. --tag step00000029")),
    Case("export-planted-extra-state", L("export", "--run", f"{R}/planted_extra", "--output", f"{R}/hf_new"),
         (f"{MODEL} holds {SYSTEM} in ",)),
    Case("export-marker-model-config-null", L("export", "--run", f"{R}/marker_null", "--tag", "step00000030",
                                              "--output", f"{R}/hf_new"),
         ("llmjp_ds.json is not a valid checkpoint marker (model_config must be an object with positive integer",)),
    Case("export-corrupt-tokenizer", L("export", "--run", f"{R}/bad_tokenizer", "--output", f"{R}/hf_new"),
         ("the run's tokenizer", "cannot be loaded", "restore it from the tokenizer the run was trained with")),
    # --- import ------------------------------------------------------------------------------------------------
    Case("import-hf-wrong-shape-tensor", L("import-hf", "--model", f"{R}/hf_wrong_shape", "--run", f"{R}/imported"),
         ("model.layers.0.mlp.down_proj.weight has shape [64, 96], but config.json implies [64, 128]",)),
    Case("import-hf-truncated-safetensors", L("import-hf", "--model", f"{R}/hf_truncated", "--run",
                                              f"{R}/imported"),
         ("model.safetensors is not a readable safetensors file", "the download is incomplete")),
    Case("import-hf-over-a-run-with-checkpoints", L("import-hf", "--model", f"{R}/hf_good", "--run", f"{R}/base",
                                                    "--force"),
         ("holds a run with checkpoints: import-hf starts a new run; choose another --run",)),
    Case("import-hf-moe-other-shape", L("import-hf", "--model", f"{R}/hf_moe", "--run", f"{R}/imported", "--preset",
                                        "demo"),
         ("hf_moe is a qwen3_moe model with num_experts=4, but the preset demo's model (shape tiny) has num_experts=0",
          "pass the preset of its shape")),
    # --- import-megatron (the fixtures megatron-core wrote, altered) -----------------------------------------------
    Case("import-megatron-not-a-checkpoint", megatron(f"{R}/precious"),
         ("precious is not a Megatron-LM checkpoint directory (no latest_checkpointed_iteration.txt, no iter_",)),
    Case("import-megatron-missing-mp-rank", megatron(f"{R}/mg_missing_rank"),
         ("lacks mp_rank_01_001: its arguments say TP 2 x PP 2; the checkpoint is incomplete",)),
    Case("import-megatron-missing-distcp", megatron(f"{R}/mg_missing_distcp"),
         ("lacks __1_0.distcp, which its .metadata lists: the checkpoint is incomplete",)),
    Case("import-megatron-missing-common-state", megatron(f"{R}/mg_missing_common"),
         ("holds neither common.pt (megatron-core 0.16 and before) nor a 'common_state' item (0.19)",)),
    Case("import-megatron-not-llama", megatron(f"{R}/mg_layernorm_1p"),
         ("was trained with layernorm_zero_centered_gamma=True: llmjp-ds continues Llama-style runs only",)),
    Case("import-megatron-layout-does-not-add-up", megatron(f"{R}/mg_extra_rank"),
         ("holds mp_rank_02_000, which does not add up to the TP 2 x PP 2 its arguments give",)),
    Case("import-megatron-other-model-shape", megatron(f"{R}/mg_base", "model.overrides.hidden_size=64"),
         ("the Megatron checkpoint has hidden_size=32, the run config model.overrides.hidden_size=64",)),
    Case("import-megatron-other-vocabulary", megatron(f"{R}/mg_base", "model.overrides.vocab_size=384"),
         ("the Megatron checkpoint has padded_vocab_size=256, the run config model.overrides.vocab_size=384",)),
    Case("import-megatron-other-tokenizer", megatron(f"{R}/mg_base", "data.tokenizer={tok}"),
         ("pieces, which Megatron pads to", "but the checkpoint's embedding has 256: pass the tokenizer the Megatron "
          "run trained with")),
    Case("import-megatron-planted-pickle", megatron(f"{R}/mg_planted"),
         (f"model_optim_rng.pt holds {SYSTEM}, which loading would have to execute",)),
    Case("import-megatron-planted-metadata", megatron(f"{R}/mg_planted_metadata"),
         (f".metadata holds {SYSTEM}, which loading would have to execute",)),
    Case("import-megatron-truncated-file", megatron(f"{R}/mg_truncated"),
         ("distrib_optim.pt is not a readable torch checkpoint file", "copy it again from the Megatron run")),
    Case("import-megatron-run-dir-exists", megatron(f"{R}/mg_base", run=f"{R}/base"),
         ("base already exists: import-megatron writes a new run directory",)),
]


# --- making the inputs ------------------------------------------------------------------------------------------

class Payload:
    """Pickles as a call that appends to ``canary`` (creating it) when unpickled: os.system, or exec of Python
    source (any callable an untrusted file names could do anything else instead)."""

    def __init__(self, canary: Path, how: str):
        self.canary, self.how = str(canary), how

    def __reduce__(self):
        if self.how == "system":
            return os.system, (f"echo ran >> '{self.canary}'",)
        return exec, (f"open({self.canary!r}, 'a').write('ran')",)


def remanifest(tag_dir: Path, name: str) -> None:
    """Rewrite the manifest entry of ``name`` to match the file (what an attacker who plants it would do)."""
    from llmjp_ds.checkpoint.manifest import digest

    marker = tag_dir / "llmjp_ds.json"
    data = json.loads(marker.read_text())
    data["files"][name] = digest(tag_dir / name)
    marker.write_text(json.dumps(data))


def _plant(run: Path, name: str, canary: Path, how: str, edit) -> None:
    import pickle

    import torch

    for tag in ("step00000029", "step00000030"):  # both: the resume must refuse, not fall back
        path = run / "checkpoints" / tag / name
        state = torch.load(path, map_location="cpu", weights_only=False)
        payload = Payload(canary, how)
        if edit == "extra":
            key = next(k for k in state["module"] if k.endswith("_extra_state"))
            state["module"][key] = torch.frombuffer(bytearray(pickle.dumps({"recipe": payload})), dtype=torch.uint8)
        else:
            state[edit] = payload
        torch.save(state, path)
        remanifest(path.parent, name)


def _copy(ctx, name: str) -> Path:
    dst = ctx.tmp / "checkpoint" / name
    shutil.copytree(ctx.run, dst, ignore=shutil.ignore_patterns(".llmjp_ds.lock"))
    return dst


def _hf_dirs(root: Path) -> None:
    """A small HF Llama (transformers' own save_pretrained), one with a wrong-shape tensor, one truncated; a small
    qwen3_moe."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, max_position_embeddings=64)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root / "hf_good")
    for name in ("hf_wrong_shape", "hf_truncated"):
        shutil.copytree(root / "hf_good", root / name)
    tensors = load_file(root / "hf_wrong_shape" / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"] = tensors["model.layers.0.mlp.down_proj.weight"][:, :96].clone()
    save_file(tensors, root / "hf_wrong_shape" / "model.safetensors", metadata={"format": "pt"})
    data = (root / "hf_truncated" / "model.safetensors").read_bytes()
    (root / "hf_truncated" / "model.safetensors").write_bytes(data[: len(data) // 2])
    moe = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=1000, max_position_embeddings=64,
                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    Qwen3MoeForCausalLM(moe).save_pretrained(root / "hf_moe")


def prepare(ctx) -> None:
    """Write this topic's inputs under ``ctx.tmp / "checkpoint"``."""
    root = ctx.tmp / "checkpoint"
    root.mkdir()
    canary = root / "canary.txt"
    canary.write_text("untouched\n")
    _copy(ctx, "base")
    for name in ("other_dtype", "other_seq_len", "other_zero_stage"):  # each its own: the cases run side by side
        _copy(ctx, name)
    for name, file, how, edit in (("planted_model", MODEL, "system", "train_state"),
                                  ("planted_optim", OPTIM, "system", "optimizer_state_dict"),
                                  ("planted_extra", MODEL, "system", "extra"),
                                  ("planted_exec", MODEL, "exec", "train_state")):
        _plant(_copy(ctx, name), file, canary, how, edit)
    (_copy(ctx, "latest_outside") / "checkpoints" / "latest").write_text("../../elsewhere/checkpoints/step00000030")
    (_copy(ctx, "latest_binary") / "checkpoints" / "latest").write_bytes(b"\xff\xfe\x00step")
    tag_link = _copy(ctx, "tag_symlink") / "checkpoints" / "step00000030"
    shutil.move(tag_link, root / "outside_tag")
    tag_link.symlink_to(root / "outside_tag")
    file_link = _copy(ctx, "file_symlink") / "checkpoints" / "step00000030" / MODEL
    shutil.copy(file_link, root / "outside_model_states.pt")
    file_link.unlink()
    file_link.symlink_to(root / "outside_model_states.pt")
    damaged = _copy(ctx, "all_damaged") / "checkpoints"
    (damaged / "step00000030" / MODEL).write_bytes(b"")
    (damaged / "step00000029" / "llmjp_ds.json").write_text('{"model_config": null}')
    no_manifest = _copy(ctx, "no_manifest")
    for tag in ("step00000029", "step00000030"):
        marker = no_manifest / "checkpoints" / tag / "llmjp_ds.json"
        data = json.loads(marker.read_text())
        data.pop("files")
        marker.write_text(json.dumps(data))
    marker = _copy(ctx, "marker_null") / "checkpoints" / "step00000030" / "llmjp_ds.json"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "model_config": None}))
    (_copy(ctx, "bad_tokenizer") / "tokenizer" / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    (root / "precious").mkdir()
    (root / "precious" / "thesis.txt").write_text("years of work")
    _hf_dirs(root)
    _megatron_dirs(root, canary)


def _megatron_dirs(root: Path, canary: Path) -> None:
    """Copies of megatron-core's fixtures: whole, a shard missing, the common state missing, a run of another
    model (LayerNorm-1p, as older releases name it in the arguments), a layout that does not add up, a planted
    pickle in a torch file and in a distributed checkpoint's .metadata, a file cut short."""
    import argparse
    import pickle

    import torch

    from llmjp_ds.checkpoint.safe_load import StandIn, load_megatron

    def copy(fixture: str, name: str) -> Path:
        shutil.copytree(MEGATRON_FIXTURES / fixture / "save", root / name)
        return next((root / name).glob("iter_*"))

    copy("torch-tp1pp1", "mg_base")
    shutil.rmtree(copy("torch-tp2pp2", "mg_missing_rank") / "mp_rank_01_001")
    (copy("torch_dist-tp2dp2-dp_reshardable", "mg_missing_distcp") / "__1_0.distcp").unlink()
    (copy("torch_dist-pp2dp2-fully_reshardable", "mg_missing_common") / "common.pt").unlink()
    common = copy("torch_dist-pp2dp2-fully_reshardable", "mg_layernorm_1p") / "common.pt"
    state = load_megatron(common)  # rewritten with the arguments as Megatron-LM pickles them, one of them changed
    plain = {k: v for k, v in vars(state["args"]).items() if not isinstance(v, StandIn)}  # not the enums
    args = argparse.Namespace(**{**plain, "apply_layernorm_1p": True})
    torch.save({k: v for k, v in state.items() if k != "rerun_state_machine"} | {"args": args}, common)
    extra = copy("torch-tp2pp2", "mg_extra_rank")
    shutil.copytree(extra / "mp_rank_01_001", extra / "mp_rank_02_000")
    torch.save({"args": Payload(canary, "system")}, copy("torch-tp1pp1", "mg_planted") / "mp_rank_00" /
               "model_optim_rng.pt")
    (copy("torch_dist-tp2dp2-dp_reshardable", "mg_planted_metadata") / ".metadata").write_bytes(
        pickle.dumps(Payload(canary, "system")))
    cut = copy("torch-tp1pp1", "mg_truncated") / "mp_rank_00" / "distrib_optim.pt"
    cut.write_bytes(cut.read_bytes()[:5000])
