"""The check of the server's --token, shared by the routes that need it: the weight routes require it,
/debug/state shows the weight group's store address only with it."""

from __future__ import annotations

import hmac
from collections.abc import Callable

from fastapi import Request

from inference_shim.backends.common import ContractError


def token_check(token: str | None) -> Callable[[Request], None]:
    """A function that raises 401 unless `request` carries `Authorization: Bearer <token>`; usable as a
    FastAPI dependency. With no token every request passes (ServeConfig allows that on loopback only)."""

    def require_token(request: Request) -> None:
        if token is None:
            return
        header = request.headers.get("authorization", "")
        # Constant time: how long a wrong token takes to refuse tells nothing about the right one.
        if not hmac.compare_digest(header.encode(), f"Bearer {token}".encode()):
            raise ContractError(
                401, "unauthorized", "send 'Authorization: Bearer <token>' (the server's --token)"
            )

    return require_token
