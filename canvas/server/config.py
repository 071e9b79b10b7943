"""`ServerConfig`: where the server listens, what it loads, who may connect, and its limits.

Invariants (checked in `__post_init__`): a non-loopback host needs a token of at least 16 characters; the port is a
valid TCP port (0 picks a free one). `dcanvas serve` maps its flags onto these fields.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from canvas.engine.prefix_cache import DEFAULT_CONTEXT_CACHE_MB
from canvas.env import TOKEN
from canvas.protocol import ServerLimits
from canvas.server.admission import AdmissionConfig
from canvas.server.security import default_origins, is_loopback

MIN_TOKEN_CHARS = 16
# The repository's web/ folder (an editable install); `--web` points elsewhere.
DEFAULT_WEB_DIR = Path(__file__).resolve().parents[2] / "web"


def default_db_path() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "dcanvas" / "documents.db"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback: nothing else on the network can connect
    port: int = 8765
    db: str = field(default_factory=lambda: str(default_db_path()))  # ":memory:" keeps nothing
    token: str | None = None  # required (checked at hello) when `host` is not loopback
    origins: tuple[str, ...] = ()  # browser origins allowed besides the server's own pages
    hosts: tuple[str, ...] = ()  # extra Host headers to serve on loopback (e.g. a reverse proxy's name)
    web_dir: str = str(DEFAULT_WEB_DIR)
    model_dir: str | None = None  # None: the default model (canvas.convert.resolve: built Gemma, else canvas-6m)
    limits: ServerLimits = field(default_factory=ServerLimits)
    max_batch: int = 8  # generations the engine runs in one batched step
    threads: int | None = None  # torch intra-op threads; None: the physical cores this process may use
    # MiB the engine's context cache may hold (`canvas.engine.prefix_cache`: encoder caches of earlier contexts,
    # reused by longest common prefix across every route); 0 keeps none
    context_cache_mb: float = DEFAULT_CONTEXT_CACHE_MB
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)  # the queue's bound (sized from the load)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.token is not None and len(self.token) < MIN_TOKEN_CHARS:
            raise ValueError(f"the token must have at least {MIN_TOKEN_CHARS} characters")
        if not is_loopback(self.host) and self.token is None:
            raise ValueError(
                f"binding to {self.host} exposes the server to the network: give a token "
                f"(--token or the {TOKEN} environment variable), or bind to 127.0.0.1"
            )
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.context_cache_mb < 0:
            raise ValueError(f"context_cache_mb must be >= 0, got {self.context_cache_mb}")

    @property
    def allowed_origins(self) -> frozenset[str]:
        return default_origins(self.port) | frozenset(self.origins)

    @property
    def allowed_hosts(self) -> list[str]:
        """Host headers served; on a public bind any (the token guards the websocket)."""
        if not is_loopback(self.host):
            return ["*"]
        return ["127.0.0.1", "localhost", "::1", "[::1]", *self.hosts]

    @classmethod
    def tiny(cls) -> ServerConfig:
        """In-memory store and small limits, for tests."""
        return cls(db=":memory:", port=0, limits=ServerLimits.tiny(), hosts=("testserver",), max_batch=4)
