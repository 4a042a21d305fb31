"""The process groups of a run: starting torch.distributed, and one object the rest asks for ranks and groups.

A :class:`ParallelContext` is made once per process, after the config is validated. Before the engine exists
it knows the world (rank, device, :class:`~llmjp_ds.parallel.layout.Layout`) and, under tensor parallelism,
DeepSpeed's pipe x data x model topology with its groups: this rank's :class:`TensorParallel` slice (the
model axis is innermost, so a slice's ranks are adjacent, on one node), its data-parallel group, and its
pipeline stage's TP x DP group (FP8's amax reduction group), and under expert parallelism DeepSpeed's expert groups
with this rank's :class:`ExpertParallel` group. :meth:`ParallelContext.bind` then takes the
data-parallel group from the engine's pipeline grid (DeepSpeed builds the same topology inside
``PipelineModule``). No process group lives in a module global.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import secrets
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from llmjp_ds.errors import fail
from llmjp_ds.io_utils import one_line_write_errors, write_bytes_atomic
from llmjp_ds.launch import launcher, rendezvous, scheduler
from llmjp_ds.launch.failure import PeerFailure, is_peer_failure
from llmjp_ds.model.expert_parallel import ExpertParallel
from llmjp_ds.model.tensor_parallel import TensorParallel
from llmjp_ds.parallel.deepspeed_internals import expert_parallel_group
from llmjp_ds.parallel.layout import Layout

SHARED_TOKEN = ".llmjp_ds_shared"


def init_distributed(rendezvous_timeout_s: float = 60.0, heartbeat_timeout_s: float = 30.0,
                     distributed_timeout_s: float = 1800.0) -> tuple[list, object]:
    """Start torch.distributed (NCCL on CUDA, gloo on CPU); a lone process gets defaults.

    Returns this rank's launchers, to notice them gone (:mod:`llmjp_ds.launch.launcher`), and its heartbeat
    (None but over several hosts), and turns a rendezvous port in use into one line naming the port, its holder
    and how to choose another. Several ranks meet through :mod:`llmjp_ds.launch.rendezvous` (bounded by
    ``rendezvous_timeout_s``), which also starts the heartbeat over several hosts (``heartbeat_timeout_s``; 0:
    none). ``distributed_timeout_s``: the process group's timeout, how long a collective waits for every rank
    (Megatron-LM's ``--distributed-timeout-minutes``)."""
    import deepspeed

    launchers = launcher.identify()  # now, while the launcher is surely alive (setup may take minutes)
    if "WORLD_SIZE" not in os.environ and "MASTER_PORT" not in os.environ:
        # a lone process (python -m llmjp_ds.train, llmjp-ds demo): its rendezvous port is private, so take a free
        # one rather than 29500, which another job on a shared machine may hold (EADDRINUSE at startup)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for key, default in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                         ("MASTER_PORT", "29500")):
        os.environ.setdefault(key, default)
    use_the_environments_ninja()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        check_build_lock()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent serves the store
    # rank 0 serves the rendezvous store on MASTER_PORT (under torchrun its agent does, and holds the port)
    serves_store = rank == 0 and not agent_store and not dist.is_initialized()  # started already: nothing to do
    if serves_store and not launcher.check_port_free(port):
        fail(launcher.port_in_use_message(addr, port))  # before torch logs its own lines about it
    heartbeat, timeout = None, datetime.timedelta(seconds=distributed_timeout_s)
    try:
        if world > 1 and not dist.is_initialized():
            heartbeat = _meet(backend, rank, world, addr, port, agent_store, rendezvous_timeout_s, heartbeat_timeout_s,
                              timeout, on_lost=lambda lost: launcher.end_launch_sessions(launchers, lost))
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
    except Exception as exc:
        if serves_store and launcher.is_address_in_use(exc):  # taken between the check and the store's bind
            fail(launcher.port_in_use_message(addr, port))
        raise
    return launchers, heartbeat


def use_the_environments_ninja() -> None:
    """torch's JIT build of DeepSpeed's ops runs the first ``ninja`` on PATH, and a launcher may put another one
    first: Open MPI's mpirun started by its full path puts its own bin/ (/usr/bin) ahead of the venv's, a login shell
    over ssh resets PATH. Ninja 1.11 and 1.12+ hash a build command differently, so runs under two launchers would
    take turns rebuilding the op in the one extensions directory (~1 min each on two cores). Where the interpreter's
    environment has its own ninja (a venv's, from DeepSpeed's dependency), it goes first on PATH."""
    own = Path(sys.executable).parent / "ninja"
    found = shutil.which("ninja")
    if own.is_file() and os.access(own, os.X_OK) and not (found and os.path.samefile(found, own)):
        os.environ["PATH"] = f"{own.parent}{os.pathsep}{os.environ.get('PATH', '')}"


def check_build_lock(name: str = "deepspeed_shm_comm", stale_after_s: float = 1800.0) -> None:
    """On the CPU DeepSpeed compiles its shared-memory op ``name`` at the first run, with torch's JIT build under a
    lock file; an interrupted build (Ctrl-C, a killed job) leaves the lock, and every later run waits on it without
    a word, forever. A lock older than ``stale_after_s`` (a build takes ~2 min) ends the run with one line naming
    it; a younger one gets a warning line, since the run will wait on it."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > stale_after_s:
        fail(f"{lock} is left from a build of DeepSpeed's {name} op interrupted {age / 60:.0f} min ago, and this run "
             "would wait on it forever: if no other run is building it, remove that file and start again")
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"warning: waiting on {lock}: a build of DeepSpeed's {name} op started {age:.0f} s ago; if no other "
              "run is building it, that build was interrupted: remove the file", flush=True)


def _meet(backend: str, rank: int, world: int, addr: str, port: int, agent_store: bool, rendezvous_timeout_s: float,
          heartbeat_timeout_s: float, timeout: datetime.timedelta, on_lost=None):
    """The rendezvous of ``world`` ranks (:mod:`llmjp_ds.launch.rendezvous`), the socket interface of the
    master's host, the process group (its collectives bounded by ``timeout``), then the heartbeat (returned; None on
    one host; ``on_lost``: what it does before it ends the job for a silent host)."""
    # under torchrun its agent serves the store (the agents met already); a restart of the workers meets in a
    # namespace of its own
    store = rendezvous.open_store(rank, world, addr, port, rendezvous_timeout_s, serve=not agent_store)
    namespace = (f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}/"
                 if agent_store else "")
    members = rendezvous.join(store, rank, world, addr, port, rendezvous_timeout_s, namespace)
    others = [m.addr for m in members if m.host != socket.gethostname()]
    if others:  # several hosts: the master's host learns the route to another one only now
        scheduler.set_socket_interface_to(addr, port, others)
    kwargs = {"device_id": torch.device("cuda", int(os.environ["LOCAL_RANK"]))} if backend == "nccl" else {}
    if agent_store:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=timeout,
                                **kwargs)
    else:
        store.set_timeout(timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **kwargs)
    return rendezvous.start_heartbeat(addr, port, rank, int(os.environ["LOCAL_RANK"]), members, heartbeat_timeout_s,
                                      namespace, on_lost)


@dataclass
class ParallelContext:
    layout: Layout
    rank: int
    device: torch.device
    dp_rank: int = 0
    dp_size: int = 1
    dp_group: object | None = None  # None: the world (no pipeline, no TP)
    tp: TensorParallel | None = None  # this rank's tensor-parallel slice (None: no tensor parallelism)
    ep: ExpertParallel | None = None  # this rank's expert-parallel group (None: every expert on every rank)
    mpu: object | None = None  # DeepSpeed's grid of the layout, handed to a ZeRO engine under TP
    stage_group: object | None = None  # this pipeline stage's ranks (TP x DP) under TP
    launchers: list = field(default_factory=list)  # the processes that launched this rank (launch.launcher)
    heartbeat: object | None = None  # this rank's heartbeat over several hosts (launch.rendezvous), else None

    @classmethod
    def start(cls, layout: Layout, sequence_parallel: bool = False, parallel=None) -> "ParallelContext":
        """The process groups of ``layout`` (``parallel``: the config's ParallelConfig, for its rendezvous,
        heartbeat and collective timeouts; None: their defaults)."""
        timeouts = {} if parallel is None else {"rendezvous_timeout_s": parallel.rendezvous_timeout_s,
                                                "heartbeat_timeout_s": parallel.heartbeat_timeout_s,
                                                "distributed_timeout_s": parallel.distributed_timeout_s}
        launchers, heartbeat = init_distributed(**timeouts)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        ctx = cls(layout=layout, rank=dist.get_rank(), device=device, dp_rank=dist.get_rank(),
                  dp_size=dist.get_world_size(), launchers=launchers, heartbeat=heartbeat)
        if layout.tensor > 1:
            ctx._tensor_groups(sequence_parallel)
        if layout.expert > 1:
            ctx.ep = expert_parallel_group(layout.expert, layout.pipeline)
        return ctx

    def _tensor_groups(self, sequence_parallel: bool) -> None:
        """Every rank makes every group, in the same order (torch.distributed requires it)."""
        from deepspeed.runtime.pipe.topology import PipelineParallelGrid

        topo = topology(self.layout)
        grid = PipelineParallelGrid(topology=topo)
        self.tp = TensorParallel(grid.get_slice_parallel_group(), self.layout.tensor,
                                 grid.get_slice_parallel_rank(), sequence_parallel)
        for stage in range(self.layout.pipeline):
            group = dist.new_group(ranks=topo.filter_match(pipe=stage))
            if stage == grid.get_stage_id():
                self.stage_group = group
        self.dp_rank, self.dp_size = grid.get_data_parallel_rank(), grid.get_data_parallel_world_size()
        self.dp_group = grid.get_data_parallel_group()
        if self.layout.pipeline == 1:
            self.mpu = grid

    def bind(self, engine) -> None:
        """Take the data-parallel rank, size and group from a pipeline engine's grid (a ZeRO engine's data
        parallelism is the world)."""
        grid = getattr(engine, "grid", None)
        if grid is not None:
            self.dp_rank = grid.get_data_parallel_rank()
            self.dp_size = grid.get_data_parallel_world_size()
            self.dp_group = grid.get_data_parallel_group()

    @property
    def amax_reduction_group(self):
        """TE's FP8 amax reduction group: under TP the stage's TP x DP group (Megatron's choice: the scales of a
        TP slice must agree, as its ranks exchange FP8 tensors); else the stage's data-parallel group under a
        pipeline (the world would hang, as stages hold different modules), or the world (None)."""
        if self.tp is not None:
            return self.stage_group
        return self.dp_group if self.layout.pipeline > 1 else None

    @property
    def loss_copies(self) -> int:
        """How many ranks hold a copy of each loss term summed by :meth:`all_reduce` (data x tensor parallel)."""
        return self.dp_size * self.layout.tensor

    def finish(self) -> None:
        """Before the last barrier of a run that ends normally: stop the heartbeat (marked finished), so that no
        rank that ends is taken for a lost one by a rank still in the barrier."""
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None

    def report_failure(self, exc: BaseException) -> None:
        """A collective failed on this rank with ``exc``: when a peer on another host closed its connections,
        say once for the job which host (:meth:`Heartbeat.report_lost_peer`)."""
        if self.heartbeat is not None and is_peer_failure(exc):
            self.heartbeat.report_lost_peer(exc)

    @contextlib.contextmanager
    def reporting_failures(self):
        """Work on this process group: a failure that a host gone without a word caused names the host
        (:meth:`report_failure`), then goes on."""
        try:
            yield
        except BaseException as exc:
            self.report_failure(exc)
            raise

    # --- collectives the trainer uses ----------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor)
        return tensor

    def barrier(self) -> None:
        dist.barrier()

    def check_shared_dir(self, path) -> None:
        """Every rank must see the same run directory (a node-local one would split checkpoints across nodes):
        rank 0 writes a fresh token into it and every rank reads it back, before anything else is written."""
        path = Path(path)
        token = [secrets.token_hex(16) if self.rank == 0 else None]
        dist.broadcast_object_list(token, src=0)
        if self.rank == 0:
            with one_line_write_errors(path / SHARED_TOKEN, "free space or choose another run_dir, then start again"):
                write_bytes_atomic(path / SHARED_TOKEN, token[0].encode())
        self.barrier()
        seen = _read_token(path / SHARED_TOKEN, token[0])
        missing = torch.tensor([0.0 if seen == token[0] else 1.0], device=self.device)
        if self.all_reduce(missing).item() == 0:
            return
        if seen == token[0]:
            raise PeerFailure("another rank does not see the run directory")
        fail(f"run_dir {path} is not shared by every rank: rank {self.rank} on {socket.gethostname()} "
             f"{'finds no' if seen is None else 'finds another'} token where rank 0 wrote one; put run_dir on a "
             "filesystem that every node mounts at the same path (checkpoints would be split across nodes)")

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any."""
        return self.any_rank_of(flag)[0]

    def any_rank_of(self, *flags: bool) -> tuple[bool, ...]:
        """Each of ``flags``, true on every rank when it is true on any (one all-reduce)."""
        t = torch.tensor([1.0 if flag else 0.0 for flag in flags], device=self.device)
        self.all_reduce(t)
        return tuple(bool(v > 0) for v in t.tolist())


def topology(layout: Layout):
    """DeepSpeed's pipe x data x model topology (the model axis innermost: a TP slice's ranks are adjacent)."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    return PipeModelDataParallelTopology(num_pp=layout.pipeline, num_mp=layout.tensor, num_dp=layout.data)


def _read_token(path: Path, expected: str, tries: int = 10) -> str | None:
    """The token in ``path``; retried briefly, as a shared filesystem may show a new file late."""
    seen = None
    for attempt in range(tries):
        try:
            seen = path.read_text().strip()
        except OSError:
            seen = None
        if seen == expected:
            break
        time.sleep(0.5 * (attempt < tries - 1))
    return seen
