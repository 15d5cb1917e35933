"""A long-lived pool of spawned compile workers that survives crashing compiles.

Each worker imports Triton once and then loops on jobs, so isolation costs no import time
per config. A worker that dies (``abort()``, segfault) or overruns the timeout fails only
its current job and is replaced. Workers share the parent's ``TRITON_CACHE_DIR``, so the
parent loads their binaries as cache hits. The same :func:`compile_job` runs in a worker
and in-process (the baseline the pool's compile time is measured against).
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib
import subprocess
import sys
import os
import socket
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Sequence

from absl import logging

from te_jax_perm.core import env
from te_jax_perm.core.launch import Launch
from te_jax_perm.core.triton_backend import CompileSpec, launch_spec

DEFAULT_TIMEOUT_S = 120.0
STARTUP_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class CompileJob:
    """A :class:`CompileSpec` a worker can be sent: the kernel named by module and name (a
    ``@triton.jit`` function does not pickle), imported again in the worker."""

    kernel_module: str
    kernel_name: str
    spec: CompileSpec    # its kernel left out
    target: tuple[str, int, int]
    label: str = ""


def make_job(launch: Launch, target: tuple[str, int, int]) -> CompileJob:
    """The compile of ``launch``'s kernel exactly as the ``triton`` backend compiles it."""
    fn = launch.decl.kernel.fn
    return CompileJob(fn.__module__, fn.__name__, dataclasses.replace(launch_spec(launch), kernel=None),
                      tuple(target), label=f"{launch.decl.name}:{launch.config}")


def compile_job(job: CompileJob) -> dict:
    """Compiles ``job``; returns a small picklable summary including the binary."""
    t0 = time.perf_counter()
    kernel = getattr(importlib.import_module(job.kernel_module), job.kernel_name)
    k = dataclasses.replace(job.spec, kernel=kernel).compile(job.target)
    binary = k.asm.get("cubin") or k.asm.get("hsaco") or b""
    meta = getattr(k, "metadata", None)
    return {"hash": k.hash, "binary": bytes(binary) if isinstance(binary, (bytes, bytearray)) else binary,
            "n_regs": getattr(k, "n_regs", None), "shared": getattr(meta, "shared", None),
            "compile_s": time.perf_counter() - t0}


@dataclasses.dataclass
class CompileResult:
    ok: bool
    info: dict[str, Any]
    error: str = ""


def _worker_main(fd: int) -> None:
    conn = Connection(fd)
    importlib.import_module("triton")  # the point of a long-lived worker: import once
    conn.send(("ready", None))
    with contextlib.suppress(EOFError):    # the parent is gone
        for job in iter(conn.recv, None):   # None: stop
            try:
                conn.send(("ok", compile_job(job)))
            except Exception:  # noqa: BLE001 - a compile error fails this job, not the worker
                conn.send(("error", traceback.format_exc(limit=4)))


class _Worker:
    """One worker: a ``python -c`` subprocess (never re-imports the parent's ``__main__``,
    so it works from scripts without a main guard) talking pickles over a socket pair."""

    def __init__(self, cache_dir: str):
        ours, theirs = socket.socketpair()
        env = dict(os.environ, TRITON_CACHE_DIR=cache_dir,
                   PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        code = f"from te_jax_perm.autotune.pool import _worker_main; _worker_main({theirs.fileno()})"
        with theirs:
            self.proc = subprocess.Popen([sys.executable, "-c", code], env=env, pass_fds=(theirs.fileno(),),
                                         stdin=subprocess.DEVNULL)
        self.conn = Connection(ours.detach())
        self.ready = False
        self.spawned = time.monotonic()
        self.job: int | None = None
        self.started = 0.0

    def exited(self, wait_s: float = 0.0) -> bool:
        """Whether the process has exited, waiting up to ``wait_s`` for it."""
        try:
            self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def stop(self, kill: bool = False) -> None:
        if kill:
            self.proc.kill()
        else:
            with contextlib.suppress(OSError):   # already gone
                self.conn.send(None)
        if not self.exited(5.0):
            self.proc.kill()
            self.proc.wait(timeout=5)
        self.conn.close()


class CompilePool:
    """``compile_many(jobs)`` compiles in parallel; results come back in job order."""

    def __init__(self, workers: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 cache_dir: str | None = None):
        self.size = max(1, workers or min(os.cpu_count() or 1, 8))
        self.timeout_s = timeout_s
        self.cache_dir = cache_dir or env.triton_cache_dir()
        self._workers = [_Worker(self.cache_dir) for _ in range(self.size)]
        self.replaced = 0

    def wait_ready(self) -> None:
        """Blocks until every worker has imported Triton (for fair timing)."""
        while not all(w.ready for w in self._workers):
            self._step([], [])

    def compile_many(self, jobs: Sequence[CompileJob]) -> list[CompileResult]:
        results: list[CompileResult | None] = [None] * len(jobs)
        todo = list(range(len(jobs)))[::-1]
        while todo or any(w.job is not None for w in self._workers):
            for w in self._workers:
                # The timeout clock starts at dispatch to a warm worker: start-up is not compile time.
                if w.ready and w.job is None and todo:
                    w.job, w.started = todo.pop(), time.monotonic()
                    w.conn.send(jobs[w.job])
            self._step(jobs, results)
        return results  # type: ignore[return-value]

    def _step(self, jobs: Sequence[CompileJob], results: list) -> None:
        """Waits on the starting and the busy workers, then takes each one's message (its
        "ready", or its job's result), or replaces it if it died or overran its time."""
        watched = [w for w in self._workers if not w.ready or w.job is not None]
        deadlines = [w.started + self.timeout_s if w.ready else w.spawned + STARTUP_TIMEOUT_S for w in watched]
        # A dead worker's pipe reads as EOF, so waiting on the pipes also sees deaths.
        ready = wait([w.conn for w in watched],
                     timeout=max(0.0, min(deadlines) - time.monotonic()) if deadlines else None)
        for w, deadline in zip(watched, deadlines):
            try:
                kind, payload = w.conn.recv() if w.conn in ready else (None, None)
            except (EOFError, OSError):
                kind, payload = None, None
            if kind == "ready":
                w.ready = True
            elif kind is not None:
                idx, w.job = w.job, None
                ok = kind == "ok"
                results[idx] = CompileResult(ok, payload if ok else {}, "" if ok else payload)
                if not ok:
                    logging.warning("autotune: %s failed to compile: %s", jobs[idx].label,
                                    payload.strip().splitlines()[-1])
            # A readable pipe that gave no message: the worker is exiting, give it a moment.
            elif w.exited(2.0 if w.conn in ready else 0.0) or time.monotonic() > deadline:
                self._replace(w, jobs, results)

    def _replace(self, w: _Worker, jobs: Sequence[CompileJob], results: list) -> None:
        """Replaces ``w``, which died or overran its time; its job, if it had one, fails."""
        if not w.ready:
            logging.warning("autotune: compile worker failed to start (exit code %s); replacing it", w.proc.poll())
            if self.replaced > 4 * self.size + 8:
                raise RuntimeError("autotune: compile workers keep failing to start")
        elif not w.exited():
            results[w.job] = CompileResult(False, {}, f"compile timed out after {self.timeout_s:.1f}s")
            logging.warning("autotune: %s hung past %.1fs; worker killed, config skipped",
                            jobs[w.job].label, self.timeout_s)
        else:   # exited: its return code is known
            results[w.job] = CompileResult(False, {}, f"compile worker died (exit code {w.proc.returncode})")
            logging.warning("autotune: %s killed its compile worker (exit code %s); config skipped",
                            jobs[w.job].label, w.proc.returncode)
        w.stop(kill=True)
        self.replaced += 1
        self._workers[self._workers.index(w)] = _Worker(self.cache_dir)

    def close(self) -> None:
        """Stops every worker (also called at exit for the shared pool)."""
        for w in self._workers:
            w.stop()
        self._workers = []


_pool: CompilePool | None = None


def get_pool() -> CompilePool:
    """The process-wide pool, started on first use and stopped at exit."""
    global _pool
    if _pool is None:
        _pool = CompilePool()
        atexit.register(shutdown_pool)
    return _pool


def shutdown_pool() -> None:
    global _pool
    if _pool is not None:
        _pool.close()
        _pool = None
