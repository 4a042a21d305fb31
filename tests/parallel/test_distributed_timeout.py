"""``parallel.distributed_timeout_s`` is the process group's timeout (Megatron-LM's --distributed-timeout-minutes):
what every collective of the run waits at most, on one process (DeepSpeed's init) and on two ranks started by
torchrun (our rendezvous, then torch's init_process_group), started as the trainer starts them."""

from __future__ import annotations

import textwrap

import pytest

from tests.launch import REPO, free_port, run, subprocess_env, torchrun

_SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    from llmjp_ds.config import load_config
    from llmjp_ds.parallel.context import ParallelContext
    from llmjp_ds.parallel.layout import Layout
    cfg = load_config(None, ["parallel.distributed_timeout_s=7200"])
    ParallelContext.start(Layout.of(cfg), parallel=cfg.parallel)  # as the trainer starts it
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    print(f"TIMEOUT {dist.get_rank()} {backend.options._timeout.total_seconds()}", flush=True)
    dist.barrier()
""")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nproc", [1, 2])
def test_the_process_group_waits_as_long_as_the_config_says(tmp_path, nproc):
    script = tmp_path / "timeout.py"
    script.write_text(_SCRIPT)
    argv = ["python", str(script)] if nproc == 1 else [*torchrun(nproc, free_port()), str(script)]
    result = run(argv, timeout=280, env=subprocess_env(PYTHONPATH=REPO), cwd=tmp_path)
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("TIMEOUT "))
    assert result.returncode == 0 and lines == [f"TIMEOUT {r} 7200.0" for r in range(nproc)], \
        result.stdout[-2000:] + result.stderr[-2000:]
