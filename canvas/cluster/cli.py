"""`dcanvas cluster scale --replicas N [--ray-address ADDR] [--app dcanvas]`: change the number of engine replicas of
a running `dcanvas serve --ray` deployment in place, without restarting its ingress (`canvas.cluster.deploy.scale`).

The ingress's /health lists the replicas that serve; new replicas are routed to as soon as they are up.
"""

from __future__ import annotations

import argparse


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="cluster_command", metavar="ACTION", required=True)
    scale = sub.add_parser("scale", help="set the number of engine replicas of a running deployment")
    scale.add_argument("--replicas", type=int, required=True, help="engine replicas wanted")
    scale.add_argument("--ray-address", default="auto",
                       help="the Ray cluster's address (default 'auto': the one started on this machine)")
    scale.add_argument("--app", default="dcanvas", help="the Serve application's name (default dcanvas)")
    scale.add_argument("--timeout", type=float, default=300, help="seconds to wait for the replicas (default 300)")
    scale.set_defaults(func=_scale)


def _scale(args: argparse.Namespace) -> int:
    import ray

    from canvas.cluster.deploy import scale

    ray.init(address=args.ray_address, log_to_driver=False)
    try:
        scale(args.app, args.replicas, wait_s=args.timeout)
    except (ValueError, KeyError, TimeoutError) as e:
        print(f"dcanvas cluster scale: {e}")
        return 1
    finally:
        ray.shutdown()
    print(f"dcanvas cluster scale: {args.app} runs {args.replicas} engine replicas")
    return 0
