"""A process that has imported the trainer's stack once and forks a fresh process for each command.

Starting ``python -m llmjp_ds.train`` costs ~3.5 s of imports (torch, DeepSpeed, transformers) on these CPUs,
several times what a tiny run trains; the suite starts hundreds. The server (``python -m tests.forkserver
SOCKET``, started once per session by :func:`start`) imports them, then forks one child per request. The child
becomes what the request names: its own session (``setsid``, as ``start_new_session`` does), working directory,
environment, standard streams (file descriptors passed over the socket) and ``python -m MODULE ARGS...``, run
as ``__main__`` at the top level of the interpreter, so its exit (``sys.exit``, an uncaught exception, a signal)
and its ``atexit`` handlers are those of a fresh process. The server reports each child's pid, then its exit
status. :class:`Forked` is the client's handle, with :class:`subprocess.Popen`'s ``pid``, ``poll``, ``wait``,
``returncode`` and ``send_signal``.

What a fork cannot give the child is set here: the OpenMP thread count (read by the runtime when torch loads) is
applied with ``torch.set_num_threads``, and the CPU capability (``ATEN_CPU_CAPABILITY``) is the session's, since
the server starts with the session's environment. Only modules of this repository run this way
(:func:`forkable`); anything else (torchrun, the deepspeed runner, other tools) is an ordinary subprocess.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# what a training, an export or a preprocess imports before it does anything
PRELOAD = ("torch", "torch.distributed", "deepspeed", "deepspeed.comm", "deepspeed.runtime.engine",
           "deepspeed.runtime.pipe.engine", "transformers", "transformers.models.llama.modeling_llama",
           "safetensors.torch", "sentencepiece", "numpy", "yaml", "psutil", "llmjp_ds.train", "llmjp_ds.cli",
           "llmjp_ds.trainer", "llmjp_ds.model", "llmjp_ds.model.llama", "llmjp_ds.parallel.context",
           "llmjp_ds.parallel.build", "llmjp_ds.parallel.runners", "llmjp_ds.checkpoint", "llmjp_ds.data.plan",
           "llmjp_ds.data.dataset", "llmjp_ds.precision.controller", "llmjp_ds.metrics.logger",
           # DeepSpeed's ZeRO optimizer check imports its Muon optimizer, whose torch.compile decorators import
           # torch._inductor (~3 s)
           "deepspeed.runtime.zero.muon.muon_optimizer")
MODULES = ("llmjp_ds.train", "llmjp_ds.cli")  # the entry points that run forked
ENV = "LLMJP_DS_TEST_FORKSERVER"  # the socket of the session's server; "0": no server (fresh interpreters)
_FDS = 3  # stdin, stdout, stderr


def forkable(argv) -> str | None:
    """The module of ``[sys.executable, "-m", MODULE, ...]`` when it may run forked, else None."""
    argv = list(map(str, argv))
    if len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m" and argv[2] in MODULES:
        return argv[2]
    return None


# --- the server -----------------------------------------------------------------------------------------------
def _preload() -> None:
    import importlib

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for name in PRELOAD:
        importlib.import_module(name)


def _recv(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds = b"", []
    while not data.endswith(b"\n"):
        chunk, more, _, _ = socket.recv_fds(conn, 1 << 20, _FDS)
        if not chunk:
            raise ConnectionError("client went away")
        data, fds = data + chunk, fds + list(more)
    return json.loads(data), fds


def serve(path: str) -> tuple[dict, list[int]]:
    """Accept requests until one is forked: returns (request, its fds) in the child; never returns in the
    server."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    while True:
        for key, _ in sel.select(timeout=0.02):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    request, fds = _recv(conn)
                except (ConnectionError, ValueError, OSError):
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    for other in (listener, conn, *children.values()):
                        other.close()
                    return request, fds
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                try:
                    conn.sendall(f"pid {pid}\n".encode())
                except OSError:
                    pass
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                conn.close()
        if os.getppid() == 1:  # the session that started us is gone
            os._exit(0)


def become(request: dict, fds: list[int]) -> str:
    """In the forked child: take the request's session, streams, directory, environment and argv; returns the
    module to run as ``__main__``."""
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1 if unbuffered else -1, closefd=False, encoding="utf-8",
                      errors="backslashreplace")
    sys.stderr = open(2, "w", buffering=1, closefd=False, encoding="utf-8", errors="backslashreplace")
    import random

    import numpy
    import torch

    random.seed()  # a fresh interpreter's unseeded generators differ from every other process's
    numpy.random.seed()
    torch.seed()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    sys.argv = [request["argv"][0], *request["argv"][3:]]
    return request["argv"][2]


def main(path: str) -> None:
    _preload()
    import gc

    # what the imports made stays put: the children's collections leave those objects (and so their pages, shared
    # with this process until written) alone
    gc.collect()
    gc.freeze()
    request, fds = serve(path)
    module = become(request, fds)
    import atexit
    import runpy

    code = [1]  # an uncaught exception: its traceback is printed before atexit, as in any interpreter

    def leave() -> None:
        """The last atexit function: end with the exit code, skipping only the teardown of the imported modules,
        which writes to nearly every page shared with the server (0.4 s a process, frozen or not)."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code[0])

    atexit.register(leave)  # registered first, so it runs after every other atexit function
    sys.modules.pop(module, None)  # preloaded: run afresh as __main__, as `python -m` would
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code[0] = 0
    except SystemExit as exc:  # the interpreter prints a message that is not a number, and exits 1 for it
        code[0] = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
        raise
    except KeyboardInterrupt:
        code[0] = 128 + signal.SIGINT
        raise


# --- the client -----------------------------------------------------------------------------------------------
class Forked:
    """A command forked by the server: :class:`subprocess.Popen`'s ``pid``, ``returncode``, ``poll``, ``wait``
    and ``send_signal`` / ``kill`` / ``terminate``."""

    def __init__(self, path: str, argv, env: dict, cwd, stdin: int, stdout: int, stderr: int):
        self.args = list(map(str, argv))
        self.returncode: int | None = None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(path)
        request = {"argv": self.args, "env": dict(env), "cwd": str(cwd)}
        socket.send_fds(self._sock, [json.dumps(request).encode() + b"\n"], [stdin, stdout, stderr])
        self._buf = b""
        line = self._line(timeout=60)
        if line is None or not line.startswith("pid "):
            raise RuntimeError(f"the fork server did not start {self.args}: {line!r}")
        self.pid = int(line.split()[1])

    def _line(self, timeout: float | None) -> str | None:
        end = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = None if end is None else max(0.0, end - time.monotonic())
            self._sock.settimeout(left)
            try:
                chunk = self._sock.recv(4096)
            except (socket.timeout, BlockingIOError):
                return None
            if not chunk:
                raise RuntimeError("the fork server went away")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        return self._wait(0.0)

    def _wait(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            line = self._line(timeout)
            if line is not None:
                self.returncode = int(line.split()[1])
                self._sock.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._wait(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def start(root: Path, env: dict) -> tuple[subprocess.Popen, str]:
    """Start a server (its socket under ``root``) and wait until it has imported everything."""
    path = str(root / "forkserver.sock")
    log = open(root / "forkserver.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "tests.forkserver", path], stdout=subprocess.PIPE, stderr=log,
                            env=env, cwd=Path(__file__).resolve().parents[1], start_new_session=True, text=True)
    for line in proc.stdout:  # the imports may log first (DeepSpeed's accelerator line)
        if line.strip() == "ready":
            return proc, path
        log.write(line)
    log.flush()
    proc.kill()
    raise RuntimeError(f"the fork server did not start: {(root / 'forkserver.log').read_text()[-2000:]}")


_server: tuple[subprocess.Popen, str, Path] | None = None
_starting = threading.Lock()  # the bad-input catalogue starts commands from two threads


def _stop() -> None:
    if _server is not None:
        proc, _, root = _server
        proc.kill()
        proc.wait()
        import shutil

        shutil.rmtree(root, ignore_errors=True)


def server_path() -> str | None:
    """The socket of this session's server, started on first use; None when ``$LLMJP_DS_TEST_FORKSERVER`` is 0
    (every command a fresh interpreter)."""
    if os.environ.get(ENV, "1") == "0":
        return None
    with _starting:
        return _server_path()


def _server_path() -> str:
    global _server
    if _server is None or _server[0].poll() is not None:
        root = Path(tempfile.mkdtemp(prefix="llmjp-ds-forkserver-"))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        if _server is None:
            atexit.register(_stop)
        _server = (*start(root, env), root)
    return _server[1]


def popen(argv, *, env: dict, cwd=None, stdin=None, stdout=None, stderr=None, fresh: bool = False):
    """``subprocess.Popen(argv, start_new_session=True, text=True, ...)``, forked from the session's server when
    ``argv`` runs one of this repository's entry points (``fresh``: never; for what only a whole interpreter
    does, such as its teardown). Streams: None (inherit), a file object or fd, ``subprocess.PIPE`` (stdout only;
    then ``.stdout`` is a text stream) or ``subprocess.STDOUT`` (stderr)."""
    path = server_path() if forkable(argv) and not fresh else None
    if path is None:
        return subprocess.Popen(list(map(str, argv)), env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr,
                                text=True, start_new_session=True)
    close, pipe_read = [], None

    def fd_of(stream, default: int) -> int:
        if stream is None:
            return default
        return stream if isinstance(stream, int) else stream.fileno()

    if stdin in (None, subprocess.DEVNULL):
        in_fd = os.open(os.devnull, os.O_RDONLY)
        close.append(in_fd)
    else:
        in_fd = fd_of(stdin, 0)
    if stdout == subprocess.PIPE:
        pipe_read, out_fd = os.pipe()
        close.append(out_fd)
    else:
        out_fd = fd_of(stdout, 1)
    err_fd = out_fd if stderr == subprocess.STDOUT else fd_of(stderr, 2)
    try:
        proc = Forked(path, argv, env, cwd or os.getcwd(), in_fd, out_fd, err_fd)
    finally:
        for fd in close:
            os.close(fd)
    proc.stdout = open(pipe_read, encoding="utf-8", errors="replace") if pipe_read is not None else None
    return proc


class Ranks:
    """``nproc`` ranks of ``python -m MODULE ...`` on this machine with the variables torchrun gives its workers
    (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), each
    started by :func:`popen`. As torchrun does, once a rank fails the others are ended (SIGTERM, then SIGKILL
    after ``GRACE_S``), and the group's exit code is the first failure's."""

    GRACE_S = 10.0

    def __init__(self, argv, nproc: int, port: int, *, env: dict, cwd=None, stdout=None, stderr=None):
        self.args = list(map(str, argv))
        self.returncode: int | None = None
        self._ending: float | None = None
        self.procs = []
        for rank in range(nproc):
            ranked = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                      "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            self.procs.append(popen(argv, env=ranked, cwd=cwd, stdout=stdout, stderr=stderr))
        self.pid = self.procs[0].pid

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        codes = [p.poll() for p in self.procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed and None in codes:
            if self._ending is None:
                self._ending = time.monotonic()
                self.send_signal(signal.SIGTERM)
            elif time.monotonic() - self._ending > self.GRACE_S:
                self.send_signal(signal.SIGKILL)
            return None
        if None not in codes:
            self.returncode = failed[0] if failed else 0
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv[1])
