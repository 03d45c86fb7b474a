"""Who a request comes from: API keys (``Authorization: Bearer``) or, without keys, the client's own id."""
from __future__ import annotations

import hmac
from typing import Iterable

from swarm.api.errors import ApiError

MAX_CLIENT_ID = 64  # X-Client-Id / client_id / user: a client naming itself (no API keys)


def match_api_key(token: str, keys: dict[str, str]) -> str | None:
    """The client an API key belongs to, or None. Every configured key is compared in constant time
    (``hmac.compare_digest``) and all of them are tried, so the answer time tells nothing about the keys."""
    supplied, found = token.encode(), None
    for key, client in keys.items():
        if hmac.compare_digest(supplied, key.encode()):
            found = client
    return found


class ClientAuth:
    """``keys``: API key -> client (none: clients name themselves); ``admins``: the clients that see operator
    detail."""

    def __init__(self, keys: dict[str, str] | None, admins: Iterable[str] = ()):
        self.keys, self.admins = dict(keys or {}), set(admins)

    def client_of(self, authorization: str | None, fallback: str | None) -> str:
        """The client: its API key's (401 without a known key), else ``fallback`` (self-declared) or anonymous."""
        if self.keys:
            token = (authorization or "").removeprefix("Bearer ").strip()
            if not token:
                raise ApiError(401, "unauthorized", "missing API key (send 'Authorization: Bearer <key>')")
            client = match_api_key(token, self.keys)
            if client is None:
                raise ApiError(401, "unauthorized", "unknown API key")
            return client
        if fallback is not None and not 0 < len(fallback) <= MAX_CLIENT_ID:
            raise ApiError(400, "invalid_request", f"a client id is 1 to {MAX_CLIENT_ID} characters")
        return fallback or "anonymous"

    def operator(self, authorization: str | None) -> bool:
        """Operator detail: for an admin client's key; for everyone when no API keys are configured (a lab)."""
        if not self.keys:
            return True
        token = (authorization or "").removeprefix("Bearer ").strip()
        return bool(token) and match_api_key(token, self.keys) in self.admins
