"""A process pool with a hard per-call timeout: a call that overruns has its worker killed and replaced.

    pool = TimeoutPool(num_workers=2, preload=("math_verify",))
    future = pool.submit(fn, arg1, arg2, timeout_s=5.0)   # a concurrent.futures.Future
    future.result()            # fn's value; raises CallTimeout, WorkerDied or WorkerError
    await asyncio.wrap_future(pool.submit(...))           # from async code, without blocking the loop
    pool.close()

Why not `concurrent.futures.ProcessPoolExecutor`: it cannot stop one running call. Killing one of its
workers marks the whole executor broken and fails every other in-flight call; a stuck sympy
computation (in C, deaf to signals) has to be killed from outside. Here each worker is one process
with its own pipe and one "slot" thread that feeds it jobs from a shared queue, waits at most
`timeout_s` for the answer, and on overrun SIGKILLs the process and starts a fresh one. Callers only
ever wait on futures, never on a process.

`fn` and its arguments are pickled, so `fn` must be importable at module level. Workers are spawned
(not forked: the parent runs threads and an event loop), import `preload` once, and only then take
jobs, so the timeout never counts start-up time.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import signal
import threading
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

logger = logging.getLogger(__name__)


class CallTimeout(TimeoutError):
    """The call ran past its timeout; its worker was killed and replaced."""


class WorkerDied(RuntimeError):
    """The worker process exited during the call (crash, OOM kill); it was replaced."""


class WorkerError(RuntimeError):
    """The function raised in the worker; the message holds the worker-side traceback."""


def _worker_main(conn: Connection, preload: Sequence[str]) -> None:
    # Ctrl-C reaches the whole process group; the parent decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for module in preload:
            __import__(module)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            fn, args = conn.recv()
        except EOFError:  # the parent closed the pipe or died
            return
        try:
            conn.send(("ok", fn(*args)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class _Worker:
    """One child process and the parent's end of its pipe."""

    def __init__(self, ctx: Any, preload: Sequence[str], start_timeout_s: float):
        self.conn, child_conn = ctx.Pipe()
        self.process: BaseProcess = ctx.Process(
            target=_worker_main, args=(child_conn, tuple(preload)), daemon=True
        )
        self.process.start()
        child_conn.close()
        if not self.conn.poll(start_timeout_s):
            self.kill()
            raise RuntimeError(f"pool worker did not start within {start_timeout_s}s")
        try:
            status, detail = self.conn.recv()
        except EOFError:
            self.kill()
            raise RuntimeError("pool worker exited while starting") from None
        if status != "ready":
            self.kill()
            raise RuntimeError(f"pool worker failed to import {list(preload)}:\n{detail}")

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=10)
        self.conn.close()


_Job = tuple[Callable[..., Any], tuple[Any, ...], float, Future]


class TimeoutPool:
    """`num_workers` processes, each fed by its own thread; see the module docstring."""

    def __init__(
        self,
        num_workers: int = 2,
        preload: Sequence[str] = (),
        start_timeout_s: float = 120.0,
        name: str = "pool",
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1; got {num_workers}")
        self._ctx = multiprocessing.get_context("spawn")
        self._preload = tuple(preload)
        self._start_timeout_s = start_timeout_s
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._workers: list[_Worker | None] = [None] * num_workers
        self._closed = False
        self.timeouts = 0
        """Calls killed for running past their timeout (each one cost a worker restart)."""
        self.deaths = 0
        """Workers that died on their own during a call."""
        self._threads = [
            threading.Thread(target=self._serve, args=(slot,), name=f"{name}-slot{slot}", daemon=True)
            for slot in range(num_workers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any, timeout_s: float) -> Future:
        """Queue `fn(*args)`; the timeout counts from when a worker starts running it."""
        future: Future = Future()
        with self._lock:  # so no job can land behind close()'s stop markers
            if self._closed:
                raise RuntimeError("TimeoutPool is closed")
            self._jobs.put((fn, args, timeout_s, future))
        return future

    def worker_pids(self) -> list[int | None]:
        """Current worker process ids (None while a slot is starting its worker)."""
        with self._lock:
            return [w.process.pid if w else None for w in self._workers]

    def _start_worker(self, slot: int) -> _Worker:
        worker = _Worker(self._ctx, self._preload, self._start_timeout_s)
        with self._lock:
            if self._closed:
                worker.kill()
                raise RuntimeError("TimeoutPool is closed")
            self._workers[slot] = worker
        return worker

    def _drop_worker(self, slot: int, worker: _Worker) -> None:
        with self._lock:
            if self._workers[slot] is worker:
                self._workers[slot] = None
        worker.kill()

    def _serve(self, slot: int) -> None:
        worker: _Worker | None = None
        try:
            worker = self._start_worker(slot)
        except RuntimeError as exc:  # retried on the next job, which then carries the error
            logger.warning("%s", exc)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, timeout_s, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                if worker is not None and not worker.process.is_alive():  # died while idle
                    self._drop_worker(slot, worker)
                    worker = None
                if worker is None:
                    worker = self._start_worker(slot)
                # send() pickles fully before writing, so a pickling error leaves the pipe clean.
                worker.conn.send((fn, args))
            except Exception as exc:
                future.set_exception(exc)
                continue
            worker = self._await_result(slot, worker, timeout_s, future)

    def _await_result(self, slot: int, worker: _Worker, timeout_s: float, future: Future) -> _Worker | None:
        """Deliver the running call's outcome; returns the slot's worker afterwards (None if it is gone)."""
        try:
            ready = worker.conn.poll(timeout_s)
            status, value = worker.conn.recv() if ready else ("timeout", None)
        except (EOFError, OSError):
            status, value = "died", None
        if status == "ok":
            future.set_result(value)
            return worker
        if status == "error":
            future.set_exception(WorkerError(value))
            return worker
        self._drop_worker(slot, worker)
        if self._closed:
            future.set_exception(RuntimeError("TimeoutPool closed during the call"))
            return None
        with self._lock:
            if status == "timeout":
                self.timeouts += 1
            else:
                self.deaths += 1
        if status == "timeout":
            future.set_exception(CallTimeout(f"call ran past its {timeout_s}s timeout; worker replaced"))
        else:
            future.set_exception(WorkerDied(f"worker exit code {worker.process.exitcode}; worker replaced"))
        try:  # replace now, so the next job does not wait for a start-up
            return self._start_worker(slot)
        except RuntimeError as exc:
            logger.warning("%s", exc)
            return None

    def close(self) -> None:
        """Cancel queued calls, stop the workers and their threads. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers = [w for w in self._workers if w]
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[3].cancel()
        for _ in self._threads:
            self._jobs.put(None)
        # Kill only the processes here: a slot thread waiting on a running call then sees EOF and
        # cleans up its own pipe (closing a pipe under another thread's poll is not safe).
        for worker in workers:
            worker.process.kill()
        for thread in self._threads:
            thread.join(timeout=10)
        for worker in workers:
            worker.kill()

    def __enter__(self) -> TimeoutPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
