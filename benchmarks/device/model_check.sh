#!/usr/bin/env bash
# On the H200: the model's GPU tests (TE backend parity, state dicts across backends, 1.8B fwd+bwd) and the
# versions of the stack. Usage (device tool): source .whl/env.sh && bash benchmarks/device/model_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python - <<'PY' 2>&1 | tee "$OUT/versions.txt"
import inspect, torch, transformers, deepspeed, transformer_engine.pytorch as te
print("torch", torch.__version__, "transformers", transformers.__version__, "deepspeed", deepspeed.__version__)
print("te", te.__version__ if hasattr(te, "__version__") else "?", "fp8", te.is_fp8_available(),
      "block", te.is_fp8_block_scaling_available())
print("autocast", inspect.signature(te.autocast))
from transformers.modeling_outputs import CausalLMOutputWithPast
print("output fields", list(CausalLMOutputWithPast.__dataclass_fields__))
PY
python -m pytest -q -s -m gpu tests/model 2>&1 | tee "$OUT/model_gpu_tests.txt"
