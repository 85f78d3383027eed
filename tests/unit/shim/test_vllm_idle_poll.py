"""The vLLM worker's bounds on its shared-memory RPC reader (inference_shim/vllm_worker.py
_patch_rpc_reader), on vLLM's real SpinCondition and real ZMQ sockets: once idle, the reader sleeps at
most IDLE_POLL_MS before it looks at the queue again, so a lost wake-up notification cannot stall
decoding for vLLM's 5 s recheck (docs/decisions.md#weight-transfer, the idle spin); its spin is clamped only once the worker
joined a weight group. No notification is ever sent here: that is the lost one.

    .venv/bin/python -m pytest -q tests/unit/test_vllm_idle_poll.py
"""

from __future__ import annotations

import threading
import time

import pytest

zmq = pytest.importorskip("zmq")
shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")

from inference_shim import vllm_worker  # noqa: E402


@pytest.fixture
def idle_reader(tmp_path):
    """A reader SpinCondition whose last read was long ago (so it sleeps on its socket), with a writer bound
    to the same address that never notifies."""
    context = zmq.Context()
    address = f"ipc://{tmp_path}/notify"
    writer = shm_broadcast.SpinCondition(is_reader=False, context=context, notify_address=address)
    reader = shm_broadcast.SpinCondition(is_reader=True, context=context, notify_address=address)
    reader.last_read = time.monotonic() - 60
    yield reader
    for socket in (reader.local_notify_socket, reader.read_cancel_socket, reader.write_cancel_socket):
        socket.close(linger=0)
    writer.local_notify_socket.close(linger=0)
    context.term()


def _returns(reader, timeout_ms) -> bool:
    """Whether reader.wait(timeout_ms) returns within 3 s with no notification (run in a thread, so a
    reader that would sleep forever cannot hang the test)."""
    done = threading.Event()
    threading.Thread(target=lambda: (reader.wait(timeout_ms), done.set()), daemon=True).start()
    return done.wait(3.0)


def test_idle_reader_wakes_without_a_notification(idle_reader):
    vllm_worker._patch_rpc_reader()  # what pr_cap_idle_sleep does at start-up
    # vLLM's own reader would sleep out the whole timeout (5 s, or forever with None) waiting for a
    # notification that, when lost, never comes.
    assert _returns(idle_reader, None), (
        "an idle reader with no timeout slept on a notification that never came"
    )
    assert _returns(idle_reader, 5000), "an idle reader slept vLLM's whole 5 s recheck interval"


def test_spin_is_clamped_only_after_joining_a_group(idle_reader, monkeypatch):
    monkeypatch.setattr(vllm_worker, "_spin_clamped", False)  # a fresh worker
    vllm_worker._patch_rpc_reader()
    idle_reader.busy_loop_s = 1.0  # vLLM's default: spin 1 s after every read
    assert _returns(idle_reader, None)
    assert idle_reader.busy_loop_s == 1.0  # start-up bounds the sleep only
    vllm_worker._patch_rpc_reader(clamp_spin=True)  # what pr_init_group does
    assert _returns(idle_reader, None)
    assert idle_reader.busy_loop_s == vllm_worker.IDLE_SPIN_S
