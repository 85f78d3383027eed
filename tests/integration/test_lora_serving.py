"""Adapter updates (contract 2.1) on real servers: a vLLM-CPU engine and the torch engine, each started with
--lora-max-rank, take peft adapters pushed in memory through the weight plane while clients stream.

What is checked, per engine: /capabilities and /v1/models say LoRA; an adapter pushed mid-generation lands
between two decode steps (the streams' version spans cross it, every request ends normally); the served
greedy tokens and logprobs then equal peft's own model within 1e-3; a second adapter replaces the first;
the base alone is still served (vLLM: `MODEL:base`); refused adapters (rank above the server's, a target
no layer has, a wrong shape, full weights) are 4xx before any byte moves and the old adapter stays served;
and the bytes on the wire are the adapter tensors' bytes.

The references are peft's LoRA models, built in this process (_peft).
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch
from support.servers import running_servers

from inference_shim.protocol import AdapterSpec
from inference_shim.weight_sender import LoraMismatch, WeightSender
from pipeline_rl.demo.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.slow

TOKEN = "lora-test-token"
RANK = 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SPEC = AdapterSpec(rank=RANK, alpha=16.0, target_modules=TARGETS)
PROMPT = [5, 6, 7, 8, 9, 10, 11]
PUSHES = 8  # adapter pushes while clients stream


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("lora-model") / "tiny", TinyModelSpec(seed=5))


def _peft(model_dir, seed: int, rank: int = RANK, targets=TARGETS):
    """A peft LoRA model on the base with a non-zero adapter (B drawn from `seed`), and its adapter
    tensors under the names peft saves."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=16, target_modules=list(targets))).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model, list(get_peft_model_state_dict(model).items())


def _greedy(url: str, model: str | None = None) -> tuple[list[int], list[float]]:
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 0, "ignore_eos": True}
    if model:
        body["model"] = model
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def _reference(model, tokens: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens and the logprobs of `tokens` under `model` (a peft or transformers model)."""
    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(PROMPT) - 1 : -1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logits.argmax(-1).tolist(), [float(logprobs[i, t]) for i, t in enumerate(tokens)]


def _assert_serves(url: str, model, name: str | None = None) -> None:
    tokens, logprobs = _greedy(url, name)
    greedy, expected = _reference(model, tokens)
    assert tokens == greedy
    assert max(abs(a - b) for a, b in zip(logprobs, expected, strict=True)) <= 1e-3


def _stream_one(url: str, started: threading.Event) -> tuple[int, str, list]:
    body = {"prompt": PROMPT, "max_tokens": 100, "ignore_eos": True, "stream": True, "temperature": 1.0}
    tokens, last = 0, None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
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


def _stream_until_stopped(url: str, started: threading.Event, stop: threading.Event, out: list) -> None:
    """Requests back to back; the last one is sent after `stop` was set (after the push returned)."""
    try:
        while True:
            last = stop.is_set()
            out.append(_stream_one(url, started))
            if last:
                return
    except Exception as e:  # surfaced by the assertions on `out`
        out.append(e)
        started.set()


def _refusals(url: str, group_ready: bool) -> None:
    """Bad adapter updates answer 4xx before any collective (the sender holds the group, so only the
    adapter's own checks can refuse them)."""
    headers = {"Authorization": f"Bearer {TOKEN}"}

    def post(adapter: dict | None, tensors: list[dict]) -> httpx.Response:
        body = {"version": 99, "tensors": tensors, "store_signing": "hmac-sha256"}
        if adapter is not None:
            body["adapter"] = adapter
        return httpx.post(f"{url}/request_weight_update", json=body, headers=headers, timeout=30)

    a = {"name": "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", "dtype": "float32"}
    too_big = post({"rank": 64, "alpha": 16, "target_modules": ["q_proj"]}, [{**a, "shape": [64, 64]}])
    assert too_big.status_code == 422 and too_big.json()["error"] == "lora_rank_too_large", too_big.text
    unknown = post({"rank": 8, "alpha": 16, "target_modules": ["qq_proj"]}, [{**a, "shape": [8, 64]}])
    assert unknown.status_code == 422 and unknown.json()["error"] == "invalid_adapter", unknown.text
    assert "q_proj" in unknown.json()["detail"]  # the layers the model has
    full = post(None, [{"name": "model.norm.weight", "dtype": "float32", "shape": [64]}])
    assert full.status_code == 422 and full.json()["error"] == "adapter_expected", full.text
    if group_ready:  # past the group check: a wrong shape is named
        shape = post({"rank": 8, "alpha": 16, "target_modules": ["q_proj"]}, [{**a, "shape": [8, 65]}])
        assert shape.status_code == 422 and shape.json()["error"] == "invalid_tensors", shape.text
        assert "shape [8, 65] != expected [8, 64]" in shape.json()["detail"]


@pytest.mark.parametrize("backend", ["vllm", "torch"])
def test_an_adapter_pushed_while_clients_stream_is_served_exactly(lora_model, tmp_path, backend):
    from transformers import AutoModelForCausalLM

    first, first_tensors = _peft(lora_model, seed=1)
    second, second_tensors = _peft(lora_model, seed=2)
    base = AutoModelForCausalLM.from_pretrained(lora_model, dtype=torch.float32).eval()
    adapter_bytes = sum(t.numel() * t.element_size() for _, t in first_tensors)
    # keep: what a pipelined run's servers use; requests in flight go on across an update.
    extra = ("--lora-max-rank", str(RANK), "--max-model-len", "128", "--kv-after-update", "keep")
    with running_servers(lora_model, tmp_path, 1, token=TOKEN, extra=extra, backend=backend) as urls:
        url = urls[0]
        caps = httpx.get(f"{url}/capabilities", timeout=10).json()
        assert (caps["lora"], caps["lora_max_rank"], caps["contract_version"]) == ("in_memory", RANK, "2.2")
        names = [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]]
        assert names == (["tiny", "tiny:base"] if backend == "vllm" else ["tiny"])
        _assert_serves(url, base)  # before any push: the base (what a fresh peft adapter computes)

        # A trainer whose adapter the servers cannot take is told so before anything is sent.
        with pytest.raises(LoraMismatch, match="--lora-max-rank 16"):
            WeightSender([url], token=TOKEN, adapter=SPEC.model_copy(update={"rank": 16})).connect()
        with pytest.raises(LoraMismatch, match="set trainer.lora"):
            WeightSender([url], token=TOKEN).connect()

        sender = WeightSender([url], token=TOKEN, backend="gloo", timeout_s=60, adapter=SPEC)
        sender.connect()
        try:
            _refusals(url, group_ready=True)
            outcomes: list[list] = [[] for _ in range(4)]
            started = [threading.Event() for _ in outcomes]
            stop = threading.Event()
            threads = [
                threading.Thread(target=_stream_until_stopped, args=(url, e, stop, out))
                for e, out in zip(started, outcomes, strict=True)
            ]
            for t in threads:
                t.start()
            try:
                assert all(e.wait(120) for e in started), "a client got no token"
                # Several pushes (the same adapter as versions 1..PUSHES), apart, so that requests in
                # flight cross at least one of them also on a loaded machine.
                reports = []
                for version in range(1, PUSHES + 1):
                    reports.append(sender.push_tensors(version, first_tensors))
                    time.sleep(0.5)
            finally:
                stop.set()
                for t in threads:
                    t.join(120)
            assert all(r.total_bytes == adapter_bytes and all(x.ok for x in r.results) for r in reports)
            spans_seen = []
            versions = list(range(PUSHES + 1))
            for out in outcomes:
                for outcome in out:
                    assert not isinstance(outcome, Exception), outcome
                    tokens, finish, spans = outcome
                    assert (tokens, finish) == (100, "length")
                    assert spans[0]["start"] == 0 and spans[-1]["end"] == tokens
                    labels = [s["version"] for s in spans]
                    first_label = versions.index(labels[0])  # consecutive versions, in order
                    assert labels == versions[first_label : first_label + len(labels)], labels
                    spans_seen.append(labels)
                assert [s["version"] for s in out[-1][2]] == [PUSHES]  # sent once the last push returned
            assert any(len(x) >= 2 for x in spans_seen), f"no request spanned an adapter update: {spans_seen}"
            _assert_serves(url, first)
            if backend == "vllm":
                _assert_serves(url, base, "tiny:base")  # the base alone, beside the adapter
            _refusals(url, group_ready=True)
            _assert_serves(url, first)  # refused updates changed nothing
            sender.push_tensors(PUSHES + 1, second_tensors)
            _assert_serves(url, second)
            state = httpx.get(
                f"{url}/debug/state", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
            ).json()
            assert (
                state["weight_version"] == PUSHES + 1 and state["last_update"]["total_bytes"] == adapter_bytes
            )
        finally:
            sender.close()
        # An adapter of another rank and fewer targets replaces the whole adapter (the other layers' zeroed).
        third, third_tensors = _peft(lora_model, seed=3, rank=4, targets=["q_proj", "v_proj"])
        spec = AdapterSpec(rank=4, alpha=16.0, target_modules=["q_proj", "v_proj"])
        sender = WeightSender([url], token=TOKEN, backend="gloo", timeout_s=60, adapter=spec)
        sender.connect()
        try:
            sender.push_tensors(PUSHES + 2, third_tensors)
            _assert_serves(url, third)
        finally:
            sender.close()


def test_a_server_without_lora_refuses_adapters(lora_model, tmp_path):
    # torch engine without --lora-max-rank: lora none; an adapter update is 422 lora_not_enabled.
    with running_servers(
        lora_model, tmp_path, 1, token=TOKEN, backend="torch", extra=("--max-model-len", "128")
    ) as urls:
        url = urls[0]
        assert httpx.get(f"{url}/capabilities", timeout=10).json()["lora"] == "none"
        with pytest.raises(LoraMismatch, match="--lora-max-rank 8"):
            WeightSender([url], token=TOKEN, adapter=SPEC).connect()
        body = {
            "version": 1,
            "tensors": [{"name": "x", "dtype": "float32", "shape": [1]}],
            "adapter": SPEC.model_dump(),
            "store_signing": "hmac-sha256",
        }
        response = httpx.post(
            f"{url}/request_weight_update",
            json=body,
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=30,
        )
        assert response.status_code == 422 and response.json()["error"] == "lora_not_enabled", response.text
        base = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 2, "model": "tiny:base"},
            timeout=30,
        )
        assert base.status_code == 200  # without LoRA the suffix means nothing special
