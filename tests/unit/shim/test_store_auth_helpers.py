"""The weight plane's store-value authentication (inference_shim.protocol sign_value / verify_value).

    pytest tests/unit/test_store_auth_helpers.py

Anyone who reaches the trainer's TCPStore can write any key, so every decision, receipt and result
carries an HMAC keyed by the server's token and bound to its key. These tests pin the value format of
docs/contract.md § Store values (an outside trainer implements it from the text), show that a value
cannot be forged, altered or replayed under another key, that the trainer-side sender refuses a forged
result (against a real local TCPStore, no server), and that /debug/state hides the store's address
from callers without the token.
"""

from __future__ import annotations

import hashlib
import hmac

import pytest

from inference_shim.protocol import (
    GroupState,
    UnauthenticatedValue,
    UpdateResult,
    decision_key,
    received_key,
    result_key,
    sign_value,
    verify_decision,
    verify_value,
)

TOKEN = "s3cret-token"
KEY = decision_key("weights", "upd-1")


def _contract_sign(token: str, key: str, payload: str) -> str:
    """The format exactly as docs/contract.md § Store values writes it, independent of our helper."""
    k = key.encode()
    mac = hmac.new(token.encode(), b"%d:%s%s" % (len(k), k, payload.encode()), hashlib.sha256)
    return f"hmac-sha256:{mac.hexdigest()}:{payload}"


def test_signed_value_has_the_documented_format_and_round_trips():
    value = sign_value(TOKEN, KEY, "go")
    assert value == _contract_sign(TOKEN, KEY, "go")
    assert verify_value(TOKEN, KEY, value.encode()) == "go"  # what TCPStore.get returns: bytes
    payload = UpdateResult(server_id="s:1", version=3, ok=True).model_dump_json()
    assert verify_value(TOKEN, "k", sign_value(TOKEN, "k", payload)) == payload  # ':' in the payload


@pytest.mark.parametrize(
    "forged",
    [
        "go",  # unsigned
        _contract_sign("another-token", KEY, "go"),  # made with another token
        _contract_sign(TOKEN, KEY, "abort").replace(":abort", ":go"),  # payload altered
        _contract_sign(TOKEN, decision_key("weights", "upd-0"), "go"),  # replayed from another update
        _contract_sign(TOKEN, decision_key("other", "upd-1"), "go"),  # from another group
        "hmac-sha256:" + "0" * 64 + ":go",
        "hmac-sha256:go",
        "",
        b"\xff\xfe go",  # not even UTF-8
    ],
)
def test_a_value_not_signed_for_this_key_with_this_token_is_refused(forged):
    with pytest.raises(UnauthenticatedValue, match="not authenticated"):
        verify_value(TOKEN, KEY, forged)


def test_values_are_bound_to_their_key_rank_and_server():
    receipt = sign_value(TOKEN, received_key("weights", "u", 1), '{"ok": true, "rank": 1}')
    with pytest.raises(UnauthenticatedValue):
        verify_value(TOKEN, received_key("weights", "u", 2), receipt)  # another worker's receipt
    result = sign_value(TOKEN, result_key("weights", "u", "http://a:1"), '{"ok": true}')
    with pytest.raises(UnauthenticatedValue):
        verify_value(TOKEN, result_key("weights", "u", "http://b:1"), result)  # another server's result
    # The key is length-prefixed: moving bytes between key and payload changes the MAC.
    assert sign_value(TOKEN, "ab", "c").split(":")[1] != sign_value(TOKEN, "a", "bc").split(":")[1]


def test_without_a_token_values_are_bare_and_a_signed_value_is_read_as_its_payload():
    assert sign_value(None, KEY, "go") == "go"
    assert verify_value(None, KEY, b"go") == "go"
    assert verify_value(None, KEY, sign_value(TOKEN, KEY, "abort")) == "abort"


def test_an_unauthenticated_decision_says_the_update_was_refused():
    assert verify_decision(TOKEN, KEY, sign_value(TOKEN, KEY, "go"), 4) == "go"
    with pytest.raises(UnauthenticatedValue) as info:
        verify_decision(TOKEN, KEY, b"go", 4)
    message = str(info.value)
    assert "decision for version 4 was not authenticated" in message and "old weights kept" in message
    assert TOKEN not in message


def test_sender_refuses_a_forged_result_and_accepts_a_signed_one():
    from inference_shim.transfer import WeightGroup, connect_store
    from inference_shim.weight_sender import WeightPushError, WeightSender

    url = "http://127.0.0.1:9"
    store = connect_store("127.0.0.1", 0, is_master=True, world_size=None, timeout_s=5)
    sender = WeightSender([url], token=TOKEN, timeout_s=2)
    try:
        sender.group = WeightGroup(store, None, 0, 2, "gloo", "weights", 2.0)
        forged = UpdateResult(server_id=url, version=1, ok=True).model_dump_json()
        store.set(result_key("weights", "u1", url), forged)  # what anyone reaching the store can do
        with pytest.raises(WeightPushError, match="not authenticated") as info:
            sender._collect_results(1, "u1")
        assert info.value.servers == [url]

        key = result_key("weights", "u2", url)
        store.set(key, sign_value(TOKEN, key, forged.replace('"version":1', '"version":2')))
        assert [r.version for r in sender._collect_results(2, "u2")] == [2]
    finally:
        sender.group = None
        sender._pool.shutdown(wait=False)


def _group() -> GroupState:
    return GroupState(
        master_address="10.1.2.3",
        master_port=41234,
        rank_offset=1,
        world_size=2,
        backend="gloo",
        group_name="weights",
        server_id="s",
        timeout_s=60,
        ranks=[1],
    )


def test_debug_state_shows_the_store_address_only_to_the_token_holder():
    from fastapi.testclient import TestClient

    from inference_shim.metrics import ShimMetrics
    from inference_shim.protocol import DebugState
    from inference_shim.server import create_app

    class StubBackend:  # only what the /debug/state route touches; no engine is needed for it
        token: str | None = None

        def debug_state(self) -> DebugState:
            return DebugState(
                weight_version=1,
                group=_group(),
                pending_update=None,
                last_update=None,
                last_error=None,
                in_flight_requests=0,
                paused=False,
                updates_applied=1,
            )

    backend = StubBackend()
    client = TestClient(create_app(backend, ShimMetrics(), token=TOKEN))  # no lifespan: nothing starts
    assert backend.token == TOKEN  # the app hands the token to the backend for signing
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = client.get("/debug/state", headers=headers)
        assert response.status_code == 200
        group = response.json()["group"]
        assert group["master_port"] is None and group["master_address"] is None
        assert group["ranks"] == [1] and "41234" not in response.text and "10.1.2.3" not in response.text
    full = client.get("/debug/state", headers={"Authorization": f"Bearer {TOKEN}"}).json()["group"]
    assert (full["master_address"], full["master_port"]) == ("10.1.2.3", 41234)
