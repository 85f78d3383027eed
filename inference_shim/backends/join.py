"""How joining the weight group fails, in words a user can act on.

A join has three phases, each with its own remedy: reaching the trainer's TCPStore ("store": is the
trainer up?), forming the process group ("group": do world_size and ranks match, did every server
join?), and the probe all-reduce that proves the ranks can exchange data ("probe": network between the
ranks). Shared by the backends (base.Backend.init_process_group) and the vLLM worker, whose errors
cross vLLM's collective_rpc as text: the phase is written into that text.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from inference_shim.protocol import InitProcessGroupRequest


def short(e: BaseException, limit: int = 400) -> str:
    """The first line of an error's text (its type name when empty), at most `limit` characters."""
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:limit]


# Share of a join's timeout_s given to reaching the trainer's store; the rest is for forming the group.
STORE_SHARE = 0.4


def store_timeout(join_timeout_s: float) -> float:
    """Deadline for reaching the trainer's store during a join of deadline join_timeout_s."""
    return max(1.0, STORE_SHARE * join_timeout_s)


JoinPhase = Literal["store", "group", "probe"]


class JoinError(RuntimeError):
    """Joining the weight group failed in `phase`. The phase travels in the text ("[join:probe] ..."),
    so it survives vLLM's collective_rpc, which hands a worker's exception back as a string."""

    def __init__(self, phase: JoinPhase, error: BaseException) -> None:
        super().__init__(f"[join:{phase}] {type(error).__name__}: {short(error)}")
        self.phase = phase


def join_phase(error: BaseException) -> JoinPhase:
    """The phase a JoinError (possibly re-raised by another process) names; "group" when it names none."""
    found = re.search(r"\[join:(store|group|probe)\]", str(error))
    return found.group(1) if found else "group"  # type: ignore[return-value]


def join_weight_group(store: Any, **kwargs: Any) -> Any:
    """transfer.join_group, its failures labelled: "probe" when the group formed but its first all-reduce
    failed or timed out (join_group raises TimeoutError only there), "group" when it never formed."""
    from inference_shim.transfer import join_group

    try:
        return join_group(store, **kwargs)
    except TimeoutError as e:
        raise JoinError("probe", e) from e
    except Exception as e:
        raise JoinError("group", e) from e


def join_failure_detail(req: InitProcessGroupRequest, phase: JoinPhase, error: BaseException) -> str:
    """What failed while joining, and what to check."""
    where = f"{req.master_address}:{req.master_port}"
    cause = f"({type(error).__name__}: {short(error)})"
    if phase == "store":
        return (
            f"could not reach the trainer's store at {where} within {store_timeout(req.timeout_s):.0f}s {cause}; "
            f"is the trainer up and listening, and is {where} reachable from this server?"
        )
    if phase == "probe":
        return (
            f"the weight group at {where} formed, but its first collective (a probe all-reduce) failed or "
            f"timed out {cause}; the ranks cannot exchange data: check that every rank can reach every "
            "other (firewalls; the interface set by GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME) and that the "
            "trainer is still in its half of the join"
        )
    return (
        f"the trainer's store at {where} answered, but the weight group did not form within "
        f"{req.timeout_s:.0f}s {cause}; every rank must join at once: check that world_size={req.world_size} "
        f"and rank_offset={req.rank_offset} match the trainer's plan, that every server of the group was "
        "asked to join, and that this server can connect to the other ranks"
    )
