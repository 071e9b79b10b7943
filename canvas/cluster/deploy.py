"""Connecting an ingress to Ray, deploying (or finding) the engine replicas, and scaling them.

Owns `ClusterConfig` (what `dcanvas serve --ray` asks for), `Cluster` (the ingress's view: a `RemoteAdmission`
over the Serve application, and `close`, which undoes only what this process started) and `scale`
(`dcanvas cluster scale`).

- Without an address, the ingress starts a local Ray (one node: this machine) and owns it: `close` shuts Serve and
  Ray down. With `--ray-address`, it joins that cluster; if the application is not there yet it deploys it (and
  deletes it again at `close`), otherwise it attaches to it as it is (several ingresses, one set of replicas).
- Serve runs without its HTTP proxies: our uvicorn server is the ingress and reaches replicas through handles.
- The application is deployed with Serve's external scaler enabled, so `scale` changes the number of replicas in
  place (the controller's `update_deployment_replicas`, which Ray's dashboard also exposes at
  `POST /api/v1/applications/<app>/deployments/EngineReplica/scale`). Redeploying with `serve.run` would work too,
  but restarts every replica (a Python-built application gets a new code version each time).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve

from canvas.cluster.records import EngineRef
from canvas.cluster.remote import RemoteAdmission, Stream
from canvas.cluster.replica import DEPLOYMENT, NAMESPACE, StatsBoard, board_name, build_app
from canvas.engine.types import GenRequest
from canvas.server.admission import AdmissionConfig

log = logging.getLogger("canvas.cluster")


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    replicas: int = 1
    address: str | None = None  # None: start a local Ray; else a running cluster's (e.g. "10.0.0.5:6379", "auto")
    app: str = "dcanvas"  # the Serve application's name: one per set of replicas
    num_gpus: float = 0  # per replica (1 on a GPU node: one engine per GPU)
    num_cpus: float = 1  # per replica, for Ray's scheduling
    # Per replica's engine; None: this machine's cores shared out between the replicas (on a local Ray), else the
    # node's physical cores.
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.num_gpus < 0 or self.num_cpus < 0:
            raise ValueError("num_gpus and num_cpus must be >= 0")


class ServeReplicas:
    """`canvas.cluster.remote.Replicas` over a Serve deployment handle and the stats board."""

    def __init__(self, handle: Any, board: Any) -> None:
        self.handle, self.board = handle, board

    def open(self, request: GenRequest, owner: Hashable, affinity: str, replacing: EngineRef | None) -> Stream:
        stream: Stream = self.handle.options(stream=True, multiplexed_model_id=affinity).generate.remote(
            request, owner, replacing)
        return stream

    async def figures(self) -> dict[str, dict[str, Any]]:
        posts: dict[str, dict[str, Any]] = await self.board.read.remote()
        return posts


class Cluster:
    def __init__(self, config: ClusterConfig, *, started_ray: bool, deployed: bool, handle: Any,
                 board: Any) -> None:
        self.config = config
        self.started_ray, self.deployed = started_ray, deployed
        self.handle, self.board = handle, board

    @classmethod
    def start(cls, config: ClusterConfig, model_dir: str, *, max_batch: int, admission: AdmissionConfig,
              ready_timeout_s: float = 300) -> Cluster:
        """Connect (or start Ray), then deploy the replicas unless the application runs already; returns when
        every replica is up."""
        started_ray = not ray.is_initialized() and config.address is None
        if not ray.is_initialized():
            if config.address is None:
                cpus = max(os.cpu_count() or 1, int(config.replicas * config.num_cpus + 0.999))
                ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
            else:
                ray.init(address=config.address, log_to_driver=False)
        serve.start(proxy_location="Disabled")  # a no-op where Serve already runs
        deployed = config.app not in serve.status().applications
        board = StatsBoard.options(  # type: ignore[attr-defined]
            name=board_name(config.app), namespace=NAMESPACE, get_if_exists=True, lifetime="detached").remote()
        if deployed:
            threads = config.threads
            if threads is None and config.address is None:  # one machine: its cores shared out
                threads = max(1, (os.cpu_count() or 1) // config.replicas)
            target = build_app(model_dir, config.replicas, max_batch, threads, admission, app=config.app,
                               num_gpus=config.num_gpus, num_cpus=config.num_cpus)
            log.info("deploying %d engine replicas of %s", config.replicas, model_dir)
            handle = serve.run(target, name=config.app, route_prefix=None, external_scaler_enabled=True)
        else:
            log.info("attaching to the running application %r", config.app)
            handle = serve.get_deployment_handle(DEPLOYMENT, app_name=config.app)
        wait_running(config.app, ready_timeout_s)
        return cls(config, started_ray=started_ray, deployed=deployed, handle=handle, board=board)

    def admission(self) -> RemoteAdmission:
        return RemoteAdmission(ServeReplicas(self.handle, self.board))

    def close(self) -> None:
        """Undo what `start` did: delete the application it deployed (and its board), stop the Ray it started."""
        if self.started_ray:  # the whole local cluster is ours: stopping Ray stops Serve, replicas and board
            ray.shutdown()
            return
        with contextlib.suppress(Exception):
            if self.deployed:
                serve.delete(self.config.app)
                ray.kill(self.board)


def wait_running(app: str, timeout_s: float) -> None:
    """Until the application's replicas are all running (after a deploy or a scale)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications.get(app)
        if status is not None and status.status == "RUNNING":
            dep = status.deployments.get(DEPLOYMENT)
            if dep is not None and dep.status == "HEALTHY":
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the Serve application {app!r} is not running after {timeout_s:.0f} s: {status}")
        time.sleep(0.5)


def scale(app: str, replicas: int, *, wait_s: float = 300) -> None:
    """Set the number of engine replicas of a running application in place (connected to its Ray already)."""
    from ray.serve._private.common import DeploymentID  # the controller's key; no public name for it yet
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    ray.get(controller.update_deployment_replicas.remote(DeploymentID(name=DEPLOYMENT, app_name=app), replicas))
    deadline = time.monotonic() + wait_s
    while True:
        dep = serve.status().applications[app].deployments[DEPLOYMENT]
        running = dep.replica_states.get("RUNNING", 0)
        if running == replicas and dep.status == "HEALTHY":
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{running} of {replicas} replicas running after {wait_s:.0f} s")
        time.sleep(0.5)
