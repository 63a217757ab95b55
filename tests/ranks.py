"""`spawn`: ``torch.multiprocessing.spawn`` for the tests' ranks, forked from one warmed-up server.

``mp.spawn`` starts a fresh interpreter per rank: each imports torch, transformers and Lightning and warms up
again (~5 s of CPU a rank, most of a two-rank test's time). Here one server process per test worker does that
once (`conftest.warm_up_first_calls`, on one thread, before any OpenMP team or other thread of ours exists), then
forks the ranks of each call. A rank is a process of its own as with ``mp.spawn``: it runs ``fn(rank, *args)``
with the caller's environment and working directory, and the call fails as ``mp.spawn`` fails (the first rank to
fail is reported, with its traceback or its signal; the others are stopped).

The server's requests and replies travel on its stdin/stdout as pickles; the ranks print to stderr (their
stdout is pointed there), so nothing they print reaches the protocol.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path

import torch.multiprocessing as mp

TIMEOUT = 600.0  # seconds one call may take, the ranks' start included; the server and its ranks are then killed

_SERVER = r"""
import atexit, importlib, os, pickle, signal, struct, sys, time, traceback
sys.path.insert(0, sys.argv[1])
requests, replies = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
os.dup2(2, 1)  # what the ranks print goes to stderr, never into the replies
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
__import__("conftest").warm_up_first_calls()


def read():
    head = requests.read(8)
    return pickle.loads(requests.read(struct.unpack("<Q", head)[0])) if len(head) == 8 else None


def rank_main(fn, rank, args, env, cwd):
    requests.close()
    replies.close()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    code = 0
    try:
        fn(rank, *args)
    except BaseException:
        code = 1
        with open(os.path.join(env["FUYOU_RANK_ERRORS"], str(rank)), "w") as f:
            f.write(traceback.format_exc())
    try:
        atexit._run_exitfuncs()  # as the interpreter of a spawned rank would at exit
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


while (request := read()) is not None:
    module, name, args, nprocs, env, cwd = request
    fn = getattr(importlib.import_module(module), name)
    pids = {}
    for rank in range(nprocs):
        pid = os.fork()
        if pid == 0:
            rank_main(fn, rank, args, env, cwd)
        pids[pid] = rank
    codes, first = {}, None
    while len(codes) < nprocs:
        pid, status = os.wait()
        codes[pids[pid]] = os.waitstatus_to_exitcode(status)
        if codes[pids[pid]] != 0 and first is None:
            first = pids[pid]  # as mp.spawn: the others are stopped, SIGTERM first, SIGKILL after 30 s
            for other, rank in pids.items():
                if rank not in codes:
                    os.kill(other, signal.SIGTERM)
            deadline = time.monotonic() + 30
            while len(codes) < nprocs and time.monotonic() < deadline:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid:
                    codes[pids[pid]] = os.waitstatus_to_exitcode(status)
                else:
                    time.sleep(0.05)
            for other, rank in pids.items():
                if rank not in codes:
                    os.kill(other, signal.SIGKILL)
    reply = pickle.dumps({"codes": codes, "first": first, "pids": {rank: pid for pid, rank in pids.items()}})
    replies.write(struct.pack("<Q", len(reply)) + reply)
    replies.flush()
"""


class _Server:
    """One rank server (a process in a session of its own, with its ranks); used by one test at a time."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(Path(__file__).parent)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)

    def call(self, request: tuple, timeout: float) -> dict:
        body = pickle.dumps(request)
        self.proc.stdin.write(struct.pack("<Q", len(body)) + body)
        self.proc.stdin.flush()
        head = self._read(8, timeout)
        return pickle.loads(self._read(struct.unpack("<Q", head)[0], timeout))

    def _read(self, n: int, timeout: float) -> bytes:
        out, fd = b"", self.proc.stdout.fileno()
        while len(out) < n:
            ready, _, _ = select.select([fd], [], [], timeout)
            if not ready:
                raise TimeoutError(f"the ranks did not finish within {timeout:.0f} s")
            chunk = os.read(fd, n - len(out))
            if not chunk:
                raise RuntimeError(f"the rank server died (exit code {self.proc.wait(timeout=30)})")
            out += chunk
        return out

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=60)


_server: _Server | None = None
_lock = threading.Lock()  # guards _server: one call at a time talks to it


def spawn(fn, args: tuple = (), nprocs: int = 2, *, timeout: float = TIMEOUT) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` forked processes and wait for all, as ``torch.multiprocessing.spawn``
    does (same exceptions). ``fn`` must be a module-level function of an importable module."""
    global _server
    import tempfile

    with _lock, tempfile.TemporaryDirectory(prefix="fuyou-rank-errors-") as errors:
        if _server is None or _server.proc.poll() is not None:
            _server = _Server()
        env = dict(os.environ, FUYOU_RANK_ERRORS=errors)
        try:
            reply = _server.call((fn.__module__, fn.__qualname__, args, nprocs, env, os.getcwd()), timeout)
        except BaseException:
            _server.kill()
            _server = None
            raise
        first = reply["first"]
        if first is None:
            return
        pid, code = reply["pids"][first], reply["codes"][first]
        error_file = Path(errors) / str(first)
        if error_file.exists():
            message = f"\n\n-- Process {first:d} terminated with the following error:\n{error_file.read_text()}"
            raise mp.ProcessRaisedException(message, first, pid)
        if code < 0:
            name = signal.Signals(-code).name
            raise mp.ProcessExitedException(f"process {first:d} terminated with signal {name}", first, pid, code, name)
        raise mp.ProcessExitedException(f"process {first:d} terminated with exit code {code:d}", first, pid, code)


def stop() -> None:
    """Stop the server (end of the test session)."""
    global _server
    with _lock:
        if _server is not None:
            _server.proc.stdin.close()  # it reads the end of its requests and exits
            try:
                _server.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _server.kill()
            _server = None
