"""Where a ``llmjp-ds bench`` step's time goes (``--profile``): GPU time by kernel category and the heaviest
kernels (torch.profiler), where the GPU waited for the host (the same trace's gaps between kernels, each put down
to the host op that launched the kernel after it), the host's time by Python function (cProfile), and the calls
that make the host wait for the GPU (CUDA's sync debug mode); and the GPU's clock and power while the timed steps
run (``nvidia-smi``), since a GPU at its power cap lowers its clock and a row's throughput with it. Pure summaries
of what the profilers and nvidia-smi report, and the profiled steps."""

from __future__ import annotations

import contextlib
import cProfile
import json
import os
import pstats
import shutil
import subprocess
import tempfile
import time
import warnings

# nvidia-smi's clocks_throttle_reasons.active bit for the software power cap
POWER_CAP = 0x4


def timed(fn, sync):
    """(fn's result, wall seconds) with the device idle at the start and fn's GPU work finished at the end."""
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


# kernel name fragments (lower case) -> category; the first rule that matches wins. FP8 casts are TE kernels:
# torch's own elementwise kernels carry "LoadWithCast" in their names and are not casts to FP8.
KERNEL_CATEGORIES = (
    ("communication", ("nccl",)),
    ("memcpy/memset", ("memcpy", "memset")),
    ("attention", ("flash", "fmha", "sdpa", "attn", "cudnn")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("norm", ("rmsnorm", "rms_norm", "layernorm", "layer_norm")),
    ("rope", ("rope", "rotary")),
    ("compiled (loss)", ("triton", "cross_entropy")),  # Inductor's triton_* kernels, or model/kernels' loss
    ("elementwise/reduce", ("at::native", "elementwise", "reduce", "vectorized", "embedding", "softmax", "scatter",
                            "gather")),
    ("fp8 cast/transpose", ("cast", "quantize", "transpose", "amax", "scale")),
    ("activation", ("swiglu", "silu", "gated_act", "act_kernel")),
)


def kernel_category(name: str) -> str:
    low = name.lower()
    for category, fragments in KERNEL_CATEGORIES:
        if any(f in low for f in fragments):
            return category
    return "other"


def profile_summary(kernels: list[tuple[str, float]], wall_s: float, top: int = 12) -> dict:
    """GPU time per kernel category and the heaviest kernels, from ``(kernel name, microseconds)`` pairs of one
    step. ``share`` is of the summed kernel time; ``idle_share`` is the part of the wall time no kernel covered
    (kernels of one stream do not overlap; the step runs on one)."""
    busy_us = sum(us for _, us in kernels)
    by_cat: dict[str, float] = {}
    by_name: dict[str, list] = {}
    for name, us in kernels:
        cat = kernel_category(name)
        by_cat[cat] = by_cat.get(cat, 0.0) + us
        entry = by_name.setdefault(name, [0.0, 0])
        entry[0] += us
        entry[1] += 1
    cats = sorted(by_cat.items(), key=lambda kv: -kv[1])
    heavy = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {"wall_ms": wall_s * 1e3, "gpu_busy_ms": busy_us / 1e3, "kernels": len(kernels),
            "idle_share": max(0.0, 1.0 - busy_us / 1e6 / wall_s) if wall_s else 0.0,
            "categories": [{"category": c, "ms": us / 1e3, "share": us / busy_us if busy_us else 0.0}
                           for c, us in cats],
            "top_kernels": [{"kernel": n[:110], "ms": v[0] / 1e3, "calls": v[1], "category": kernel_category(n)}
                            for n, v in heavy]}


# trace event categories: what runs on the GPU, and the host calls that launch it (correlated by id)
GPU_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_EVENTS = ("cuda_runtime", "cuda_driver")
HOST_OPS = ("cpu_op", "user_annotation")
BACKWARD_OP = "autograd::engine::evaluate_function"


def _enclosing_ops(ops: list[tuple[float, float, str]], times: list[float]) -> list[list[str]]:
    """For each of the sorted ``times``, the names of the ``ops`` (``(start, end, name)`` of one thread, properly
    nested) that were running then, outermost first."""
    ops = sorted(ops, key=lambda o: (o[0], -o[1]))
    out, stack, i = [], [], 0
    for t in times:
        while i < len(ops) and ops[i][0] <= t:
            while stack and stack[-1][1] < ops[i][0]:
                stack.pop()
            stack.append(ops[i])
            i += 1
        while stack and stack[-1][1] < t:
            stack.pop()
        out.append([o[2] for o in stack if o[1] >= t])
    return out


def idle_gaps(events: list[dict], queued_us: float = 5.0, top: int = 10) -> dict:
    """Where the GPU waited for the host in one traced step, from the events of torch.profiler's chrome trace.
    Every gap between one GPU operation's end and the next one's start is put down to the host op that launched
    the next (the launch call's correlation id; its enclosing ops on that thread, outermost first). Gaps under
    ``queued_us`` are the GPU's own turnaround between queued kernels, reported as one sum; the longer ones mean
    the host fell behind, and are summed by side (``backward``: inside an autograd engine's function; else
    ``forward/step``) and by the outermost and innermost launching op."""
    xs = [e for e in events if e.get("ph") == "X"]
    gpu = sorted((e for e in xs if e.get("cat") in GPU_EVENTS), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in xs
                if e.get("cat") in LAUNCH_EVENTS and "correlation" in e.get("args", {})}
    small_us, small_n, gaps = 0.0, 0, []
    end = None
    for e in gpu:
        gap = 0.0 if end is None else e["ts"] - end
        if gap > 0:
            if gap < queued_us:
                small_us, small_n = small_us + gap, small_n + 1
            else:
                gaps.append((gap, launches.get(e.get("args", {}).get("correlation"))))
        end = e["ts"] + e["dur"] if end is None else max(end, e["ts"] + e["dur"])
    by_tid: dict = {}
    for e in xs:
        if e.get("cat") in HOST_OPS:
            by_tid.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    queries: dict = {}
    for k, (_, launch) in enumerate(gaps):
        if launch is not None:
            queries.setdefault(launch["tid"], []).append((launch["ts"], k))
    stacks: dict[int, list[str]] = {}
    for tid, qs in queries.items():
        qs.sort()
        for (_, k), names in zip(qs, _enclosing_ops(by_tid.get(tid, []), [t for t, _ in qs])):
            stacks[k] = names
    sides: dict[str, float] = {}
    outer: dict[str, list] = {}
    inner: dict[str, list] = {}
    for k, (gap, launch) in enumerate(gaps):
        names = stacks.get(k) or ["(unknown)" if launch is None else launch["name"]]
        side = "backward" if any(n.startswith(BACKWARD_OP) for n in names) else "forward/step"
        sides[side] = sides.get(side, 0.0) + gap
        for table, name in ((outer, names[0]), (inner, names[-1])):
            entry = table.setdefault(name, [0.0, 0])
            entry[0] += gap
            entry[1] += 1

    def rows(table):
        ranked = sorted(table.items(), key=lambda kv: -kv[1][0])[:top]
        return [{"op": n[:100], "ms": v[0] / 1e3, "gaps": v[1]} for n, v in ranked]

    return {"queued_us": queued_us, "short_ms": small_us / 1e3, "short": small_n,
            "long_ms": sum(g for g, _ in gaps) / 1e3, "long": len(gaps),
            "by_side": {s: ms / 1e3 for s, ms in sorted(sides.items())},
            "by_outer": rows(outer), "by_inner": rows(inner)}


# an MoE step's parts, by the host ops that launch their kernels (TE's, in ours and in Megatron-Core alike): the first
# whose fragment is in the name of one of the enclosing ops, forward or backward
MOE_PARTS = (("grouped GEMM", ("groupedlinear", "grouped_linear", "grouped_gemm")),
             ("permutation", ("permute", "sort_chunks")),
             ("routing", ("topk", "aux_loss", "score_for", "router")))


def moe_shares(events: list[dict]) -> dict:
    """The share of one traced step's kernel time in each of :data:`MOE_PARTS` (the rest is ``other``), each
    kernel put down to the host ops enclosing its launch (its correlation id; the launching thread's op stack)."""
    xs = [e for e in events if e.get("ph") == "X"]
    kernels = [e for e in xs if e.get("cat") == "kernel"]
    launches = {e["args"]["correlation"]: e for e in xs
                if e.get("cat") in LAUNCH_EVENTS and "correlation" in e.get("args", {})}
    by_tid: dict = {}
    for e in xs:
        if e.get("cat") in HOST_OPS:
            by_tid.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    queries: dict = {}
    for k in kernels:
        launch = launches.get(k.get("args", {}).get("correlation"))
        if launch is not None:
            queries.setdefault(launch["tid"], []).append((launch["ts"], k["dur"]))
    totals = {name: 0.0 for name, _ in MOE_PARTS}
    totals["other"] = sum(k["dur"] for k in kernels)
    for tid, qs in queries.items():
        qs.sort()
        for (_, dur), names in zip(qs, _enclosing_ops(by_tid.get(tid, []), [t for t, _ in qs])):
            low = " ".join(names).lower()
            part = next((name for name, fragments in MOE_PARTS if any(f in low for f in fragments)), None)
            if part is not None:
                totals[part] += dur
                totals["other"] -= dur
    busy = sum(k["dur"] for k in kernels)
    return {name: {"ms": us / 1e3, "share": us / busy if busy else 0.0} for name, us in totals.items()}


def host_summary(rows, wall_s: float, top: int = 15) -> dict:
    """The host's share of one step by Python function, from cProfile rows ``(file, line, function, calls,
    self seconds, cumulative seconds)``: the heaviest by self time (where the interpreter is busy) and by
    cumulative time (which call paths cost). cProfile slows Python calls, so shares matter, not absolutes."""
    def entry(r):
        return {"function": f"{_short_path(r[0])}:{r[1]}({r[2]})", "calls": r[3], "self_ms": r[4] * 1e3,
                "cum_ms": r[5] * 1e3}

    return {"wall_ms": wall_s * 1e3,
            "by_self": [entry(r) for r in sorted(rows, key=lambda r: -r[4])[:top]],
            "by_cumulative": [entry(r) for r in sorted(rows, key=lambda r: -r[5])[:top]]}


def _short_path(path: str) -> str:
    return path.replace("\\", "/").split("site-packages/")[-1].split("/llmjp_ds/")[-1]


def sync_summary(sites: list[tuple[str, int]], top: int = 10) -> dict:
    """How often one step made the host wait for the GPU, from the ``(file, line)`` of each synchronising call
    (CUDA's sync debug mode reports each as a warning at the Python line that made it). A few per step (the
    optimizer's norm and overflow checks) cost little; one per micro-batch stalls the host's queueing of
    kernels as often as there are micro-batches."""
    counts: dict[str, int] = {}
    for path, line in sites:
        where = f"{_short_path(path)}:{line}"
        counts[where] = counts.get(where, 0) + 1
    return {"count": len(sites),
            "sites": [{"where": w, "calls": n} for w, n in sorted(counts.items(), key=lambda kv: -kv[1])[:top]]}


def profile_table(result: dict) -> str:
    p = result["profile"]
    lines = [f"profile {result['shape']} {result['variant']}: step {p['wall_ms']:.0f} ms, kernels "
             f"{p['gpu_busy_ms']:.0f} ms in {p.get('kernels', 0):,} kernels, GPU idle {100 * p['idle_share']:.1f}%",
             "| category | ms per step | share of kernel time |", "|---|---|---|"]
    lines += [f"| {c['category']} | {c['ms']:.1f} | {100 * c['share']:.1f}% |" for c in p["categories"]]
    lines += ["| top kernel | category | ms | calls |", "|---|---|---|---|"]
    lines += [f"| `{k['kernel']}` | {k['category']} | {k['ms']:.1f} | {k['calls']} |" for k in p["top_kernels"]]
    moe = p.get("moe")
    if moe and any(part["ms"] for name, part in moe.items() if name != "other"):
        lines.append("profile MoE parts (kernel time by the host ops that launch it): " + ", ".join(
            f"{name} {part['ms']:.1f} ms ({100 * part['share']:.1f}%)" for name, part in moe.items()))
    gaps = p.get("idle_gaps")
    if gaps:
        sides = ", ".join(f"{side} {ms:.1f} ms" for side, ms in gaps["by_side"].items())
        lines.append(f"GPU waiting for the host: {gaps['long_ms']:.1f} ms in {gaps['long']:,} gaps of "
                     f"{gaps['queued_us']:g} us or more ({sides}); {gaps['short_ms']:.1f} ms in {gaps['short']:,} "
                     "shorter gaps between queued kernels")
        for key, title in (("by_outer", "outermost host op launching the next kernel"),
                           ("by_inner", "innermost host op launching the next kernel")):
            lines += [f"| {title} | ms | gaps |", "|---|---|---|"]
            lines += [f"| `{r['op']}` | {r['ms']:.1f} | {r['gaps']} |" for r in gaps[key]]
    host = result.get("host_profile")
    if host:
        lines.append(f"host {result['shape']} {result['variant']}: step {host['wall_ms']:.0f} ms under cProfile")
        for key, ms, title in (("by_self", "self_ms", "self ms"), ("by_cumulative", "cum_ms", "cumulative ms")):
            lines += [f"| function | calls | {title} |", "|---|---|---|"]
            lines += [f"| `{f['function']}` | {f['calls']} | {f[ms]:.1f} |" for f in host[key]]
    syncs = result.get("syncs")
    if syncs:
        lines += [f"host synchronisations in one step of {result['gas']} micro-batches: {syncs['count']}",
                  "| where | calls |", "|---|---|"]
        lines += [f"| `{x['where']}` | {x['calls']} |" for x in syncs["sites"]]
    return "\n".join(lines)


def profiled_step(step, sync, cuda: bool) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    with profile(activities=activities) as prof:
        _, wall = timed(step, sync)
    kernels = [(e.name, e.time_range.elapsed_us()) for e in prof.events()
               if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    summary = profile_summary(kernels, wall)
    if cuda:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
        summary["idle_gaps"] = idle_gaps(events)
        summary["moe"] = moe_shares(events)
    return summary


def host_profiled_step(step, sync) -> dict:
    sync()
    with cProfile.Profile() as prof:
        _, wall = timed(step, sync)
    rows = [(f, line, fn, nc, tt, ct) for (f, line, fn), (_, nc, tt, ct, _) in pstats.Stats(prof).stats.items()]
    return host_summary(rows, wall)


def synced_step(step, sync) -> dict:
    import torch

    sites = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):
            sites.append((filename, lineno))

    sync()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sync()
    return sync_summary(sites)


def clock_summary(lines) -> dict:
    """Mean SM clock (MHz), mean power (W) and the share of samples held by the power cap, from nvidia-smi's
    ``--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader,nounits`` lines
    (lines it could not read, such as ``[N/A]``, are left out); empty without samples."""
    samples = []
    for line in lines:
        fields = [f.strip() for f in line.split(",")]
        try:
            samples.append((float(fields[0]), float(fields[1]), int(fields[2], 16)))
        except (ValueError, IndexError):
            continue
    if not samples:
        return {}
    n = len(samples)
    return {"samples": n, "sm_mhz": sum(s[0] for s in samples) / n, "power_w": sum(s[1] for s in samples) / n,
            "power_capped": sum(1 for s in samples if s[2] & POWER_CAP) / n}


@contextlib.contextmanager
def clock_log(gpu: str | None, interval_ms: int = 100):
    """Sample ``gpu``'s (an nvidia-smi ``--id``: index or UUID) SM clock, power and throttle reasons while the
    block runs; the yielded dict is filled with :func:`clock_summary` at its end. Nothing is sampled (the dict
    stays empty) without a GPU or without nvidia-smi."""
    summary: dict = {}
    smi = shutil.which("nvidia-smi")
    if gpu is None or smi is None:
        yield summary
        return
    with tempfile.TemporaryFile(mode="w+") as out:
        proc = subprocess.Popen([smi, f"--id={gpu}", "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active",
                                 "--format=csv,noheader,nounits", f"--loop-ms={interval_ms}"],
                                stdout=out, stderr=subprocess.DEVNULL)
        try:
            yield summary
        finally:
            proc.terminate()
            proc.wait()
            out.seek(0)
            summary.update(clock_summary(out.read().splitlines()))
