"""How late the server's event loop runs: the gauge behind `/health`'s `loop_lag_ms`.

Owns one task (`LoopLag.run`, started by the app's lifespan) that sleeps `interval_s` over and over and records by
how much each wake-up overshot. A request handled on the loop waits at most about that long behind whatever blocked
the loop, so the figure is what a client feels as added latency. `stats` reports p50, p99 and max of the last
`window_s` seconds (a ring of samples: constant memory however long the server runs) and the max since start.

Invariant: the task only sleeps and appends; it never raises out of `run` except on cancellation.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LagConfig:
    interval_s: float = 0.1
    window_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.interval_s <= self.window_s:
            raise ValueError(f"need 0 < interval_s <= window_s, got {self.interval_s} and {self.window_s}")


class LoopLag:
    def __init__(self, config: LagConfig | None = None) -> None:
        self.config = config or LagConfig()
        self._samples: deque[float] = deque(maxlen=max(1, round(self.config.window_s / self.config.interval_s)))
        self.max_ever_s = 0.0

    def record(self, lag_s: float) -> None:
        lag_s = max(0.0, lag_s)
        self._samples.append(lag_s)
        self.max_ever_s = max(self.max_ever_s, lag_s)

    async def run(self) -> None:
        interval = self.config.interval_s
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(interval)
            self.record(time.monotonic() - t0 - interval)

    def stats(self) -> dict[str, float | int | None]:
        """Lag in milliseconds over the last window: p50, p99, max; `max_ever` since start; `samples` in the window."""
        xs = sorted(self._samples)
        if not xs:
            return {"p50": None, "p99": None, "max": None, "max_ever": None, "samples": 0,
                    "window_s": self.config.window_s}  # fmt: skip

        def pct(q: float) -> float:
            return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3, 2)

        return {"p50": pct(0.5), "p99": pct(0.99), "max": round(xs[-1] * 1e3, 2),
                "max_ever": round(self.max_ever_s * 1e3, 2), "samples": len(xs), "window_s": self.config.window_s}
