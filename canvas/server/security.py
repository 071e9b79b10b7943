"""Who may talk to the server: the bind/token policy, the Origin allow-list, token checks and rate limits.

Invariants:
- A server bound to anything but loopback has a token (`ServerConfig` refuses to exist otherwise).
- Browsers always send `Origin` on a websocket upgrade; a page from another site must not drive a local server
  (cross-site websocket hijacking), so an upgrade with an `Origin` outside the allow-list is refused before
  `accept()`. Programs (editors, the TUI) send no `Origin` and are let through; the token is their gate.
- Hosts: on loopback only loopback `Host` headers are served, which defeats DNS rebinding of `GET /` and `/ws`.
- Tokens are compared in constant time.
- Browsers cannot set headers on a websocket, so a token may also come as a subprotocol the client offers,
  `dcanvas.token.<base64url of its UTF-8, unpadded>`, next to `dcanvas.v1`. The server only ever selects
  `dcanvas.v1`: the secret is never echoed back in the handshake response.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
import re
import time
from collections.abc import Callable, Iterable

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})


def is_loopback(host: str) -> bool:
    if host.strip("[]").lower() in {"localhost", "::1"}:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def default_origins(port: int) -> frozenset[str]:
    """The origins of pages this server itself serves on loopback."""
    return frozenset(f"http://{h}:{port}" for h in ("127.0.0.1", "localhost", "[::1]"))


def normalize_origin(origin: str) -> str:
    return origin.strip().rstrip("/").lower()


def origin_allowed(origin: str | None, allowed: Iterable[str]) -> bool:
    """None (no header: not a browser) is allowed; `null` (sandboxed or file:// pages) never is."""
    if origin is None:
        return True
    o = normalize_origin(origin)
    return o != "null" and o in {normalize_origin(a) for a in allowed}


TOKEN_SUBPROTOCOL_PREFIX = "dcanvas.token."
_BASE64URL = re.compile(r"[A-Za-z0-9_-]*")


def token_subprotocol(token: str) -> str:
    """The subprotocol that carries `token` (base64url keeps any token within the characters a subprotocol allows)."""
    return TOKEN_SUBPROTOCOL_PREFIX + base64.urlsafe_b64encode(token.encode("utf-8")).decode("ascii").rstrip("=")


def subprotocol_tokens(offered: Iterable[str]) -> tuple[str | None, ...]:
    """The tokens in the subprotocols a client offered; None for one that does not decode (it matches no token)."""
    out: list[str | None] = []
    for proto in offered:
        if not proto.startswith(TOKEN_SUBPROTOCOL_PREFIX):
            continue
        data = proto[len(TOKEN_SUBPROTOCOL_PREFIX) :]
        try:
            if not _BASE64URL.fullmatch(data):
                raise ValueError(data)
            out.append(base64.urlsafe_b64decode(data + "=" * (-len(data) % 4)).decode("utf-8"))
        except (ValueError, binascii.Error):
            out.append(None)
    return tuple(out)


def authorized(presented: Iterable[str | None], expected: str | None) -> bool:
    """Whether the tokens a client presented (in `hello`, in its subprotocols) let it in: at least one, and every
    one of them right. A server without a token lets everyone in."""
    if expected is None:
        return True
    given = list(presented)
    return bool(given) and all(token_ok(t, expected) for t in given)


def token_ok(given: str | None, expected: str | None) -> bool:
    if expected is None:
        return True
    if given is None:
        return False
    return hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))


class TokenBucket:
    """`rate` tokens a second up to `burst`; each message takes one."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self._clock = rate, float(burst), clock
        self._tokens = float(burst)
        self._at = clock()

    def take(self) -> bool:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False
