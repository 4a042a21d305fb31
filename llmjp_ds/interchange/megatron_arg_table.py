"""Every Megatron-LM argument ``llmjp-ds from-megatron`` knows, in three tables: the ones it carries into the run
config (:mod:`.megatron_args` reads each), the ones it leaves out because they change nothing llmjp-ds computes
or llmjp-ds does the same its own way (each with the reason it prints), and the ones it refuses because llmjp-ds
would train something else (each with the reason and the fix). An argument in none of them is refused too: its
meaning is unknown here. docs/llmjp4-recipe.md's table says the same per argument."""

from __future__ import annotations

CARRIED = frozenset({
    # the shape
    "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--group-query-attention",
    "--num-query-groups", "--kv-channels", "--qk-layernorm", "--seq-length", "--max-position-embeddings",
    "--position-embedding-type", "--no-position-embedding", "--rotary-base", "--rotary-percent", "--normalization",
    "--norm-epsilon", "--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--attention-dropout", "--hidden-dropout", "--attention-softmax-in-fp32", "--init-method-std",
    "--tokenizer-type", "--tokenizer-model", "--make-vocab-size-divisible-by",
    # a mixture of experts
    "--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size", "--moe-layer-freq",
    "--moe-router-load-balancing-type", "--moe-aux-loss-coeff", "--moe-z-loss-coeff", "--moe-expert-capacity-factor",
    "--moe-token-drop-policy", "--moe-router-dtype",
    # AdamW and the LR schedule
    "--optimizer", "--lr", "--min-lr", "--adam-beta1", "--adam-beta2", "--adam-eps", "--clip-grad",
    "--weight-decay", "--start-weight-decay", "--end-weight-decay", "--weight-decay-incr-style",
    "--train-iters", "--train-samples", "--lr-warmup-iters", "--lr-warmup-samples", "--lr-warmup-fraction",
    "--lr-warmup-init", "--lr-decay-iters", "--lr-decay-samples", "--lr-decay-style", "--lr-wsd-decay-style",
    "--lr-wsd-decay-iters", "--lr-wsd-decay-samples", "--override-opt-param-scheduler",
    "--use-checkpoint-opt-param-scheduler",
    # batches, data, validation
    "--micro-batch-size", "--global-batch-size", "--rampup-batch-size", "--step-batch-size-schedule",
    "--data-path", "--data-cache-path", "--split", "--seed", "--eval-interval", "--eval-iters",
    "--iterations-to-skip",
    # layout and precision
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
    "--sequence-parallel", "--use-distributed-optimizer", "--distributed-timeout-minutes", "--bf16",
    "--recompute-granularity", "--recompute-activations", "--recompute-modules",
    # saves and logging that have keys here
    "--save-interval", "--log-interval", "--wandb-project", "--wandb-exp-name",
})

IMPLEMENTATION = "how Megatron-LM computes it; llmjp-ds computes the same math with its own kernels (model.*)"
OVERLAP = ("DeepSpeed overlaps ZeRO's communication itself (zero_optimization.overlap_comm in the DeepSpeed JSON, "
           "parallel.ds_config)")
LAUNCH = ("how Megatron-LM's ranks start; llmjp-ds takes torchrun's, Slurm's and Open MPI's ranks by itself "
          "(docs/multi-gpu.md)")
LOGGING = "Megatron-LM's own logging; llmjp-ds writes metrics.jsonl and wandb (logging.*)"
CHECKPOINT_IO = ("Megatron-LM's checkpoint files; llmjp-ds keeps its own in run_dir/checkpoints, saved in the "
                 "background (checkpoint.*)")
NO_AXIS = ("a parallel axis llmjp-ds does not have; the same math, with {what} on each rank (parallel.* has TP, "
           "PP and ZeRO data parallelism)")
RUN_CONTROL = ("how Megatron-LM stops or checks a run; llmjp-ds's own are health.*, train.max_nonfinite_steps and "
               "checkpoint.stop_signals")
LOADER = "how Megatron-LM's data loader works; llmjp-ds reads the same samples in the same order its own way"

NOT_CARRIED = {
    **dict.fromkeys(("--use-mcore-models", "--use-flash-attn", "--no-masked-softmax-fusion", "--masked-softmax-fusion",
                     "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
                     "--no-gradient-accumulation-fusion", "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl",
                     "--no-persist-layer-norm", "--transformer-impl", "--attention-backend", "--moe-grouped-gemm",
                     "--moe-permute-fusion", "--moe-router-fusion", "--moe-token-dispatcher-type", "--manual-gc",
                     "--manual-gc-interval", "--tp-comm-overlap", "--use-fused-weighted-squared-relu"),
                    IMPLEMENTATION),
    **dict.fromkeys(("--overlap-grad-reduce", "--overlap-param-gather", "--align-grad-reduce",
                     "--align-param-gather"), OVERLAP),
    **dict.fromkeys(("--use-mpi", "--distributed-backend", "--local-rank"), LAUNCH),
    **dict.fromkeys(("--log-throughput", "--log-progress", "--tensorboard-dir", "--tensorboard-log-interval",
                     "--log-timers-to-tensorboard", "--log-memory-to-tensorboard",
                     "--log-validation-ppl-to-tensorboard", "--timing-log-level", "--wandb-save-dir",
                     "--log-params-norm", "--log-num-zeros-in-grad", "--log-world-size-to-tensorboard"), LOGGING),
    "--moe-per-layer-logging": "each step's record carries every layer's routing (logging.expert_load_interval)",
    **dict.fromkeys(("--save", "--load", "--ckpt-format", "--async-save", "--no-load-optim", "--no-load-rng",
                     "--no-save-optim", "--no-save-rng", "--use-checkpoint-args", "--exit-on-missing-checkpoint",
                     "--dist-ckpt-strictness", "--ckpt-fully-parallel-save", "--ckpt-fully-parallel-load",
                     "--non-persistent-save-interval", "--ckpt-assume-constant-structure"), CHECKPOINT_IO),
    "--finetune": ("a fine-tune start (the weights of --load alone): set model.init_from_checkpoint to the llmjp-ds "
                   "checkpoint of those weights (llmjp-ds import-megatron makes one of a Megatron-LM checkpoint)"),
    **dict.fromkeys(("--expert-model-parallel-size", "--expert-tensor-parallel-size"),
                    NO_AXIS.format(what="every expert")),
    **dict.fromkeys(("--num-virtual-stages-per-pipeline-rank", "--virtual-pipeline-model-parallel-size",
                     "--num-layers-per-virtual-pipeline-stage", "--decoder-first-pipeline-num-layers",
                     "--decoder-last-pipeline-num-layers", "--account-for-embedding-in-pipeline-split",
                     "--account-for-loss-in-pipeline-split"),
                    NO_AXIS.format(what="one contiguous group of layers per pipeline stage")),
    **dict.fromkeys(("--recompute-method", "--recompute-num-layers"),
                    "recompute changes memory and time, not the result; llmjp-ds's is model.recompute"),
    **dict.fromkeys(("--exit-interval", "--exit-duration-in-mins", "--exit-signal-handler", "--rerun-mode",
                     "--check-for-nan-in-loss-and-grad", "--no-check-for-nan-in-loss-and-grad",
                     "--check-for-spiky-loss", "--empty-unused-memory-level", "--check-weight-hash-across-dp-replicas-"
                     "interval"), RUN_CONTROL),
    **dict.fromkeys(("--num-workers", "--dataloader-type", "--no-mmap-bin-files", "--mmap-bin-files",
                     "--num-dataset-builder-threads", "--no-create-attention-mask-in-dataloader",
                     "--create-attention-mask-in-dataloader"), LOADER),
}

DTYPE = "trains in bf16 or fp32 only (precision.dtype); FP8 phases are precision.phases (docs/precision.md)"
FP8 = ("is an FP8 setting: llmjp-ds's FP8 runs in phases with their own recipes (precision.phases, docs/precision.md); "
       "remove the FP8 arguments from a copy of the file and add the phases to the written config")
ROUTER = ("changes how the router scores or picks experts in a way llmjp-ds does not compute (its router: softmax over "
          "the top k of the logits); the run cannot be carried")

REFUSED = {
    "--fp16": f"asks for fp16: llmjp-ds {DTYPE}",
    **dict.fromkeys(("--fp8-format", "--fp8-recipe", "--fp8-margin", "--fp8-amax-history-len",
                     "--fp8-amax-compute-algo", "--fp8-interval", "--fp8-wgrad", "--fp8-param-gather"), FP8),
    "--mock-data": "trains on synthetic data: give the run its corpora (--data-path) instead",
    **dict.fromkeys(("--train-data-path", "--valid-data-path", "--test-data-path"),
                    "gives a split its own corpora: llmjp-ds splits one blend (data.blend and data.split); give "
                    "--data-path and --split instead"),
    **dict.fromkeys(("--moe-router-score-function", "--moe-router-pre-softmax", "--moe-router-enable-expert-bias",
                     "--moe-router-topk-scaling-factor", "--moe-router-num-groups", "--moe-router-group-topk",
                     "--moe-router-force-load-balancing"), ROUTER),
    "--moe-shared-expert-intermediate-size": "asks for shared experts, which llmjp-ds's MoE model does not have",
    "--add-qkv-bias": "gives the QKV projection a bias, which llmjp-ds's Llama layers do not have",
    "--apply-layernorm-1p": "shifts the norms' weights by one, which llmjp-ds's RMSNorm does not do",
    "--vocab-size": "sets the vocabulary of a null tokenizer (synthetic data): give the run its tokenizer instead",
}
