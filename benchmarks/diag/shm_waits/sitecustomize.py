"""Diagnostic of lost wake-ups in vLLM's idle worker (docs/engines.md, "vLLM", idle polling;
docs/decisions.md, "Weight transfer"): log every wait of vLLM's shared-memory RPC reader that lasts over
0.3 s, in every process that has this folder on PYTHONPATH (servers inherit the benchmark's env):

    PYTHONPATH=benchmarks/diag/shm_waits SHM_WAITS_LOG=/tmp/shm_waits.log \
        .venv/bin/python -m benchmarks inflight --repeats 3 --doc /tmp/d.md --results-dir /tmp/d \
        --img-dir /tmp/d --out-dir /tmp/d

One line per wait: pid, start (time.monotonic(), comparable with the bench's window times in its JSON),
duration, the timeout asked for and the reader's spin window. A wait of the whole 5,000 ms while
requests are running is a lost wake-up. Patches the module when it is first imported, nothing else.
"""

import importlib.abc
import importlib.machinery
import os
import sys
import time

TARGET = "vllm.distributed.device_communicators.shm_broadcast"
LOG = os.environ.get("SHM_WAITS_LOG", "/tmp/shm_waits.log")


def _log_long_waits(module) -> None:
    original = module.SpinCondition.wait

    def wait(self, timeout_ms=None):
        start = time.monotonic()
        try:
            return original(self, timeout_ms)
        finally:
            took = time.monotonic() - start
            if took > 0.3:
                with open(LOG, "a") as f:
                    f.write(
                        f"{os.getpid()} start={start:.3f} dur={took:.3f} timeout_ms={timeout_ms} "
                        f"busy={getattr(self, 'busy_loop_s', None)}\n"
                    )

    module.SpinCondition.wait = wait


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _log_long_waits(module)

        spec.loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _PatchOnImport())
