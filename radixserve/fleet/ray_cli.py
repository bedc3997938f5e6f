"""``radixserve ray-serve``: radixserve engines as Ray Serve replicas, routed by our policy.

Joins an existing Ray cluster (``--address auto`` or ``ray://HOST:10001`` after ``ray
start``) or starts a local one, deploys the application of ``ray_serve.py`` and serves HTTP
on ``--host``/``--port`` until interrupted. Needs the ``ray`` extra
(``pip install 'radixserve[ray]'``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import signal
import time

from radixserve.cli_options import ENGINE_FLAGS, add_engine_args, engine_config_from_args


def add_ray_parser(sub: argparse._SubParsersAction) -> None:
    from radixserve.router.cli import add_router_policy_args

    p = sub.add_parser(
        "ray-serve",
        help="serve on a Ray cluster: replicas are engines, routed by the cache-aware policy",
        description=__doc__.split("\n\n")[1].replace("\n", " ").replace("``", ""),
    )
    p.add_argument(
        "--address", help="Ray cluster to join (auto, ray://...); default: start a local one"
    )
    p.add_argument("--replicas", type=int, default=2, help="engine replicas; default %(default)s")
    p.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves per replica")
    p.add_argument("--host", default="127.0.0.1", help="HTTP address; default %(default)s")
    p.add_argument("--port", type=int, default=8000, help="HTTP port; default %(default)s")
    p.add_argument("--served-model-name", help="the model id clients send")
    add_engine_args(p)
    add_router_policy_args(p, prefix="router-")
    p.set_defaults(func=cmd_ray_serve, parser=p)


def engine_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    config = engine_config_from_args(parser, args)  # validates every flag here, not in Ray
    names = [*ENGINE_FLAGS, "enable_prefix_caching"]
    return {k: v for k, v in config.options().items() if k in names}


def cmd_ray_serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if importlib.util.find_spec("ray") is None:
        parser.error("Ray is not installed: pip install 'radixserve[ray]'")
    if args.replicas < 1:
        parser.error(f"--replicas must be at least 1, got {args.replicas}")
    from radixserve.router.cli import policy_config_from_args

    options = engine_options(parser, args)
    policy = dataclasses.asdict(policy_config_from_args(parser, args))
    policy.pop("block_size")
    import ray
    from ray import serve

    from radixserve.fleet.ray_serve import build_app

    ray.init(address=args.address or "local", include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    app = build_app(options, args.replicas, args.policy, policy, args.served_model_name,
                    args.replica_cpus)  # fmt: skip
    serve.run(app, name="radixserve", route_prefix="/")
    print(f"radixserve on Ray Serve listening on http://{args.host}:{args.port} "
          f"({args.replicas} replicas, {args.policy})", flush=True)  # fmt: skip
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    try:
        while not stop:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
