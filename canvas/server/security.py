"""Who may talk to the server: the bind/token policy, the Origin allow-list, token checks and rate limits.

Invariants:
- A server bound to anything but loopback has a token (`ServerConfig` refuses to exist otherwise).
- Browsers always send `Origin` on a websocket upgrade; a page from another site must not drive a local server
  (cross-site websocket hijacking), so an upgrade with an `Origin` outside the allow-list is refused before
  `accept()`. Programs (editors, the TUI) send no `Origin` and are let through; the token is their gate.
- Hosts: on loopback only loopback `Host` headers are served, which defeats DNS rebinding of `GET /` and `/ws`.
- Tokens are compared in constant time.
"""

from __future__ import annotations

import hmac
import ipaddress
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
