"""Serve genrl rewards over HTTP on Ray Serve: one copy of a reward model for every process of
every run that points at it, on GPUs of its own, in a Python environment of its own.

    # 2 replicas, one GPU each, beside a training job on the other GPUs of the machine
    CUDA_VISIBLE_DEVICES=6,7 python serve_rewards.py --reward_fn hpsv3 --num_replicas 2 --num_gpus_per_replica 1 \
        --reward_options '{"hpsv3": {"checkpoint": "/models/HPSv3"}}' --host 0.0.0.0 --port 8000
    # the trainer (every rank) then scores through it
    accelerate launch --num_processes 6 train_genrl.py --reward_fn hpsv3 \
        --reward_options '{"hpsv3": {"service": "http://localhost:8000"}}' ...

Any reward the registry knows is served (``hpsv3``, ``videoalign_*``, ``pickscore``,
``toy_geneval*``, ``jpeg_compressibility``, ``vlm_judge``, a ``module:function`` importable here)
with its own ``--reward_options``; its clients read from ``GET /health`` what the trainer reads of
an in-process reward (whether it may abstain, its models' records). Without ``--ray_address`` a Ray instance of this machine is started and
stopped with the service; with one, the replicas go on that Ray cluster (its nodes must import
genrl and the rewards' libraries). The service stops on Ctrl-C or SIGTERM. See
docs/reward_service.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.abspath(__file__))
APP_NAME = "genrl-rewards"


class OneLineErrorParser(argparse.ArgumentParser):
    """Errors in one line (``--help`` still shows the usage)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineErrorParser(prog="serve_rewards.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    group = parser.add_argument_group("rewards")
    group.add_argument("--reward_fn", required=True,
                       help="Rewards to serve, as train_genrl.py names them ('hpsv3,videoalign_ta'); weights are the trainer's and ignored here.")
    group.add_argument("--reward_options", default=None,
                       help="JSON (or a .json file) mapping reward names to their options, e.g. checkpoint folders.")
    group = parser.add_argument_group("replicas")
    group.add_argument("--num_replicas", type=int, default=1, help="Copies of the rewards, each answering requests.")
    group.add_argument("--num_gpus_per_replica", type=float, default=0.0,
                       help="GPUs of each replica (0: the CPU; 0.5: two replicas share one GPU).")
    group.add_argument("--num_cpus_per_replica", type=float, default=1.0, help="CPU cores (and torch threads) of each replica.")
    group.add_argument("--max_batch_requests", type=int, default=8,
                       help="Requests, from any trainer process, joined into one scoring call at most.")
    group.add_argument("--batch_wait_s", type=float, default=0.01,
                       help="How long the first request of a batch waits for others to join it.")
    group = parser.add_argument_group("where")
    group.add_argument("--host", default="127.0.0.1", help="Address to listen on (0.0.0.0: every interface).")
    group.add_argument("--port", type=int, default=8000, help="HTTP port of the service.")
    group.add_argument("--ray_address", default=None,
                       help="A running Ray cluster to deploy on ('auto', 'ray://head:10001'); default: a Ray instance of this machine.")
    group.add_argument("--num_cpus", type=int, default=None,
                       help="CPU cores the local Ray instance may use (default: all); ignored with --ray_address.")
    args = parser.parse_args(argv)
    for flag in ("num_replicas", "max_batch_requests"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}.")
    for flag in ("num_gpus_per_replica", "num_cpus_per_replica", "batch_wait_s"):
        if getattr(args, flag) < 0:
            parser.error(f"--{flag} must be >= 0, got {getattr(args, flag)}.")
    return args


def check_rewards(args: argparse.Namespace) -> dict:
    """The rewards and their options, checked before Ray starts; one sentence when they are not."""
    from genrl.rewards import check_reward_options, load_reward_options, parse_reward_spec
    from genrl.rewards.service import is_served

    parse_reward_spec(args.reward_fn)
    options = load_reward_options(args.reward_options)
    if isinstance(options, dict):
        served = [name for name, opts in options.items() if is_served(opts)]
        if served:
            raise ValueError(f"--reward_options names a service for {served[0]!r}: a reward service scores its rewards itself.")
    check_reward_options(options, [args.reward_fn])
    return options


def deploy(args: argparse.Namespace, options: dict) -> None:
    """Start (or join) Ray and run the replicas; returns once they answer."""
    import ray
    from ray import serve

    from genrl.rewards.serving import RewardReplica

    if args.ray_address is None:
        # The replicas' processes inherit this environment: genrl and the user's reward modules import there too.
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.getcwd(), os.environ.get("PYTHONPATH")) if p)
        ray.init(address="local", num_cpus=args.num_cpus or os.cpu_count(), include_dashboard=False,
                 logging_level="warning", configure_logging=True)
    else:
        ray.init(address=args.ray_address, logging_level="warning")
    signal.signal(signal.SIGTERM, _stop)  # after ray.init, which installs a handler of its own
    quiet = {"log_level": "WARNING", "enable_access_log": False}  # no line per request
    serve.start(http_options={"host": args.host, "port": args.port}, logging_config=quiet)
    device = "cuda" if args.num_gpus_per_replica > 0 else "cpu"
    threads = max(1, int(args.num_cpus_per_replica))
    deployment = serve.deployment(RewardReplica, name="rewards").options(
        num_replicas=args.num_replicas, max_ongoing_requests=4 * args.max_batch_requests,
        ray_actor_options={"num_cpus": args.num_cpus_per_replica, "num_gpus": args.num_gpus_per_replica},
    )
    serve.run(deployment.bind(args.reward_fn, options, device, threads, args.max_batch_requests, args.batch_wait_s),
              name=APP_NAME, route_prefix="/", logging_config=quiet)


def shutdown(args: argparse.Namespace) -> None:
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    if args.ray_address is not None:  # a shared cluster: only this service's application goes
        serve.delete(APP_NAME)
    ray.shutdown()  # a local instance goes with every process it started


def _stop(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        options = check_rewards(args)
    except (ValueError, ImportError) as e:
        raise SystemExit(f"serve_rewards.py: error: {e}") from None
    started = time.perf_counter()
    try:
        try:
            deploy(args, options)
        except (RuntimeError, ValueError) as e:  # a replica that could not build its rewards: Ray's error ends with why
            lines = [line for line in str(e).strip().splitlines() if line.strip()]
            raise SystemExit(f"serve_rewards.py: error: the replicas did not start: {lines[-1].strip() if lines else e}") from None
        url = f"http://{args.host}:{args.port}"
        print(f"serve_rewards.py: serving {args.reward_fn!r} at {url} ({args.num_replicas} replica(s), "
              f"{args.num_gpus_per_replica:g} GPU(s) each), ready in {time.perf_counter() - started:.1f} s; "
              f"Ctrl-C stops it.", flush=True)
        while True:
            signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not interrupt the shutdown
        shutdown(args)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
