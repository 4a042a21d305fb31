# gpu-tests: every test marked gpu: the TE backend against transformers' Llama, state dicts across backends, the
# fused kernels against their references, the FP8 paths, the bench on one GPU. ARGS: pytest's (default: tests).
gpu_tests gpu-tests "${@:-tests}"
