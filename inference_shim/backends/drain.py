"""Drain-then-swap (--update-mode drain): the servers of one update take turns, so a fleet never stops
admitting all at once.

A server in drain mode applies an update only once no request is in flight: it stops admitting (503
draining), lets its requests end on the old weights, applies, then admits again; no response mixes two
versions (base.Backend._run_update runs the drain, docs/engines.md "Drain-then-swap" the whole story).
Draining costs the server its admissions, so the servers of one update drain one at a time, in the
order they draw tickets from a counter in the trainer's TCPStore, which every server already holds:

    ticket = store.add(drain_ticket_key(group, update_id), 1)       # 1, 2, 3, ... in arrival order
    ticket 1 drains at once; ticket k waits until drain_done_key(..., k - 1) is set
    once applied (or failed), the holder of ticket k sets drain_done_key(..., k), signed

The wait for a turn has a deadline (the caller's: --drain-timeout-s, within the update's timeout_s):
a server that dies mid-drain never sets its key, and the next one then drains anyway, logged. A done
key whose signature does not verify counts as not set (protocol.verify_value). The counter itself is
an integer (store.add cannot carry a signature): whoever can write the store can reorder turns or make
a server wait out its deadline, never make it apply anything.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from inference_shim.protocol import (
    UnauthenticatedValue,
    drain_done_key,
    drain_ticket_key,
    sign_value,
    verify_value,
)

log = logging.getLogger("inference_shim")

# How often a server waiting for its turn checks its predecessor's key. A check is one quick store
# round trip; a blocking store.wait would hold a thread for the whole wait and logs a warning each time
# it times out.
TURN_POLL_S = 0.1


class DrainTurn:
    """One server's turn to drain for one update (its ticket), from drawing it to handing it on.

    take() draws a ticket and returns when this server may drain: its predecessor's done key is set,
    or the monotonic deadline passed (logged). release() sets this ticket's done key; call it once the
    update is applied or has failed, whatever happened after take() began (a missing release makes the
    next server wait out its deadline)."""

    def __init__(self, store: Any, token: str | None, group_name: str, update_id: str, server_id: str):
        self.store = store
        self.token = token
        self.group_name = group_name
        self.update_id = update_id
        self.server_id = server_id
        self.ticket: int | None = None

    async def take(self, deadline: float) -> str:
        """Wait for this server's turn until `deadline` (time.monotonic()); how it came: "first" (ticket 1),
        "given" (the predecessor handed it on) or "deadline" (it did not in time: drain anyway)."""
        self.ticket = int(await asyncio.to_thread(self.store.add, self._tickets, 1))
        if self.ticket == 1:
            return "first"
        key = drain_done_key(self.group_name, self.update_id, self.ticket - 1)
        while time.monotonic() < deadline:
            if await asyncio.to_thread(self.store.check, [key]):
                try:
                    verify_value(self.token, key, await asyncio.to_thread(self.store.get, key))
                    return "given"
                except UnauthenticatedValue as e:  # not the predecessor's word: as if never set
                    log.warning("drain turn %d: %s; waiting out the turn's deadline", self.ticket, e)
                    await asyncio.sleep(max(0.0, deadline - time.monotonic()))
                    break
            await asyncio.sleep(min(TURN_POLL_S, max(0.0, deadline - time.monotonic())))
        log.warning(
            "drain turn %d of update %s: the server holding turn %d did not hand it on in time (slow, or "
            "it died mid-drain); draining now, beside it",
            self.ticket,
            self.update_id,
            self.ticket - 1,
        )
        return "deadline"

    async def release(self) -> None:
        """Hand the turn on (no-op before a ticket was drawn)."""
        if self.ticket is None:
            return
        key = drain_done_key(self.group_name, self.update_id, self.ticket)
        await asyncio.to_thread(self.store.set, key, sign_value(self.token, key, self.server_id))

    @property
    def _tickets(self) -> str:
        return drain_ticket_key(self.group_name, self.update_id)
