"""Pieces of the contract that need no engine: the wire format the trainer picks from what the servers
advertise, bucket packing, version spans from SGLang's reports, the SGLang backend's launch command and
its legacy engines, join failures naming their phase, and the chain fan-out's positions and chunks."""

from __future__ import annotations

import httpx
import pytest

from inference_shim.fanout import chunk_spans, position
from inference_shim.protocol import Bucket, BucketSlot, TensorMeta, plan_buckets
from inference_shim.weight_sender import WeightPushError, choose_wire
from inference_shim.wires import packed_bucket


# ---------------------------------------------------------------------------------------------------
# Wire formats: how the trainer adapts to what the servers advertise (no engine needed)
# ---------------------------------------------------------------------------------------------------
def test_sender_picks_the_wire_format_every_server_offers():
    urls = ["http://a", "http://b"]
    assert choose_wire(urls, [["gloo", "nccl"], ["gloo"]], "gloo") == "contract"
    assert choose_wire(urls, [["nccl:c10d", "gloo:c10d"]] * 2, "gloo") == "c10d"
    with pytest.raises(WeightPushError, match="cannot mix"):
        choose_wire(urls, [["gloo", "nccl"], ["nccl:c10d", "gloo:c10d"]], "gloo")
    with pytest.raises(WeightPushError):
        choose_wire(urls, [["gloo"], ["gloo"]], "nccl")


def test_packed_bucket_drops_alignment_gaps_and_keeps_order():
    metas = [TensorMeta(name=n, dtype="float32", shape=s) for n, s in [("a", [3]), ("b", [5]), ("c", [2, 2])]]
    (aligned,) = plan_buckets(metas, bucket_bytes=4096)
    assert [s.offset for s in aligned.slots] == [0, 64, 128]
    assert packed_bucket(aligned) == Bucket(
        nbytes=12 + 20 + 16,
        slots=[BucketSlot(index=0, offset=0, nbytes=12), BucketSlot(index=1, offset=12, nbytes=20),
               BucketSlot(index=2, offset=32, nbytes=16)],
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# SglangBackend pieces that need no engine
# ---------------------------------------------------------------------------------------------------
def test_version_spans_come_from_sglang_when_it_reports_them_else_from_arrival():
    from inference_shim.backends.common import spans_from_versions
    from inference_shim.backends.sglang_backend import _engine_spans

    meta = {
        "weight_versions": [{"version": "3", "start": 0, "end": 5}, {"version": "4", "start": 5, "end": 9}]
    }
    assert [(s.version, s.start, s.end) for s in _engine_spans(meta, 9)] == [(3, 0, 5), (4, 5, 9)]
    assert _engine_spans({"weight_versions": [{"version": "default", "start": 0, "end": 9}]}, 9) is None
    assert _engine_spans({}, 9) is None
    assert [(s.version, s.start, s.end) for s in spans_from_versions([3, 3, 4, 4, 4])] == [
        (3, 0, 2),
        (4, 2, 5),
    ]


def test_sglang_backend_launch_command_and_legacy_engines_without_update_sessions(tiny_model):
    import asyncio

    from inference_shim.backends.sglang_backend import SglangBackend, SglangOptions
    from inference_shim.backends.sglang_client import SglangClient
    from inference_shim.metrics import ShimMetrics

    options = SglangOptions(
        model=str(tiny_model), kv_after_update="keep", extra_args=["--log-level", "warning"]
    )
    backend = SglangBackend(options, ShimMetrics())
    argv = backend.process.argv(1234)
    assert argv[3:5] == ["-m", "sglang.launch_server"] and argv[argv.index("--port") + 1] == "1234"
    # The engine's API key travels in its environment, never on a command line (/proc/*/cmdline).
    assert backend.process.api_key not in " ".join(argv) and "--api-key" not in argv
    assert "--disable-radix-cache" in argv and argv[-2:] == ["--log-level", "warning"]
    assert backend.pause_mode == "in_place"
    with pytest.raises(ValueError, match="incremental"):
        SglangOptions(model="m", extra_args=["--incremental-streaming-output"])

    calls: list[str] = []

    def engine(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        return httpx.Response(404, json={"detail": "Not Found"})

    client = SglangClient("http://engine", "key", transport=httpx.MockTransport(engine))

    async def run() -> None:
        await client.begin_session(5)
        await client.end_session(5)
        await client.aclose()

    asyncio.run(run())
    assert calls == ["/begin_weight_update"] and client.has_sessions is False


def test_join_failures_name_their_phase_across_process_boundaries():
    from inference_shim.backends.join import JoinError, join_failure_detail, join_phase
    from inference_shim.protocol import InitProcessGroupRequest

    # vLLM's collective_rpc hands a worker's exception back as text inside its own RuntimeError.
    remote = RuntimeError(f"Worker failed with error '{JoinError('probe', TimeoutError('all-reduce'))}'")
    assert join_phase(remote) == "probe" and join_phase(TimeoutError("rpc deadline")) == "group"
    req = InitProcessGroupRequest(
        master_address="10.0.0.1", master_port=29500, rank_offset=1, world_size=3, backend="gloo",
        server_id="s", timeout_s=10,
    )  # fmt: skip
    assert "is the trainer up" in join_failure_detail(req, "store", ConnectionError("refused"))
    assert "probe all-reduce" in join_failure_detail(req, "probe", remote)
    assert "world_size=3" in join_failure_detail(req, "group", remote)


def test_chain_position_and_chunks():
    first = position([0, 3, 1], 0)
    assert (first.previous, first.next) == (None, 3)
    middle = position([0, 3, 1], 3)
    assert (middle.previous, middle.next) == (0, 1)
    assert position([0, 3, 1], 1).next is None
    with pytest.raises(ValueError, match="not in the chain"):
        position([0, 1], 2)
    with pytest.raises(ValueError, match="once"):
        position([0, 1, 1], 1)
    assert chunk_spans(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_spans(0, 4) == []
