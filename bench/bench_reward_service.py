"""The reward service's cost and saving: the same rewards scored in-process and through
``serve_rewards.py`` (started here on localhost, stopped at the end).

Per reward spec and batch size it prints the median seconds of a batch in-process
(``inproc_s``) and served (``served_s``), samples/s of each, the service path's overhead as a
fraction of the reward's own time (``overhead``: served / in-process - 1) and the part of it
spent packing the request on the trainer (``encode_s``). Then the samples/s of ``--clients``
threads sending at once (the ranks of a run: the service batches their requests), and the
resident memory of one trainer-side process that built the rewards in-process against one that
holds only the client (``rss_inproc_mb``, ``rss_client_mb``): the saving per extra process.

    python bench/bench_reward_service.py --quick         # toy rewards, small batches, seconds after Ray starts
    python bench/bench_reward_service.py --rewards pickscore --reward_options '{"pickscore": {"checkpoint": "..."}}' \
        --num_gpus_per_replica 1 --batch_sizes 8,32,128

``--epoch`` instead runs the no-argument training run (recipes/toy_nft.yaml: ``toy_geneval``)
twice per ``--rounds``, scoring in-process and through a service serving ``toy_geneval`` (one
CPU replica), and prints each run's epoch seconds after the first (``time/epoch_s``, and the
wait for rewards after the last rollout, ``time/reward_s``), their medians and the served run's
ratio to the in-process one (the goal: at most 1.05)::

    python bench/bench_reward_service.py --epoch              # 5 epochs a run, a few minutes each on 2 cores
    python bench/bench_reward_service.py --epoch --quick      # 3 small epochs a run: that it works

Figures are printed, never asserted: on a shared CPU the overhead is mostly the HTTP round
trip and the replica's hop through Ray's proxy (a few milliseconds), large against the toy
rewards' own milliseconds and small against a model's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch

import common
from bench_rewards import toy_clips
from common import emit, time_interleaved

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_REWARDS = "toy_geneval,jpeg_compressibility"
# --epoch --quick: the no-argument run's code path on 8 samples an epoch and one small evaluation.
QUICK_EPOCH = ["--group_size", "4", "--rollout_batch_size", "8", "--rollout_batches_per_epoch", "1",
               "--train_batch_size", "8", "--gradient_accumulation_steps", "1", "--eval_max_batches", "1",
               "--eval_samples_per_prompt", "1", "--eval_diversity_prompts", "2"]

# The RSS of a process that built ``spec`` (with ``options``) and scored one batch, in MiB.
RSS_SNIPPET = """
import json, sys, torch
from genrl.rewards import build_reward_fn
spec, options, n, size = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
reward_fn = build_reward_fn(spec, options=options)
reward_fn(torch.rand(n, 3, 1, size, size), ["a red circle"] * n)
print([int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:")][0] / 1024)
"""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--rewards", default=DEFAULT_REWARDS, help="Registered reward names, comma-separated.")
    parser.add_argument("--reward_options", default=None, help="JSON options of the rewards (given to both sides).")
    parser.add_argument("--batch_sizes", default=None, help="Samples per batch, comma-separated (default 4,16,64; 4,16 with --quick).")
    parser.add_argument("--image_size", type=int, default=None, help="Square image side (default 256; 32 with --quick).")
    parser.add_argument("--clients", type=int, default=4, help="Threads sending batches at once, as the ranks of a run.")
    parser.add_argument("--num_gpus_per_replica", type=float, default=0.0, help="The service's GPUs per replica.")
    parser.add_argument("--port", type=int, default=None, help="The service's port (default: a free one).")
    parser.add_argument("--epoch", action="store_true",
                        help="Epoch seconds of the no-argument training run, toy_geneval served vs in-process.")
    parser.add_argument("--epochs", type=int, default=None, help="--epoch: epochs a run (default 5; 3 with --quick).")
    parser.add_argument("--rounds", type=int, default=1, help="--epoch: in-process and served runs, alternating, this many each.")
    args = parser.parse_args(argv)
    args.epochs = args.epochs or (3 if args.quick else 5)
    if args.epochs < 2:
        parser.error("--epochs must be at least 2: the first epoch is not reported.")
    args.batch_sizes = [int(b) for b in (args.batch_sizes or ("4,16" if args.quick else "4,16,64")).split(",")]
    args.image_size = args.image_size or (32 if args.quick else 256)
    args.repeats = args.repeats or (3 if args.quick else 10)
    return args


def start_service(args, port: int, rewards: str | None = None) -> tuple[subprocess.Popen, str, float]:
    """``serve_rewards.py`` serving ``rewards`` (default ``args.rewards``) on localhost: its
    process, URL and start-up seconds."""
    command = [sys.executable, os.path.join(ROOT, "serve_rewards.py"), "--reward_fn", rewards or args.rewards,
               "--port", str(port), "--num_gpus_per_replica", str(args.num_gpus_per_replica)]
    if args.reward_options:
        command += ["--reward_options", args.reward_options]
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=5).read()
            return proc, url, time.perf_counter() - start
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"serve_rewards.py exited {proc.returncode} before it answered") from None
            time.sleep(0.5)


def stop_service(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)  # it stops the Ray instance it started
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def resident_mb(spec: str, options: dict, n: int, size: int) -> float:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", RSS_SNIPPET, spec, json.dumps(options), str(n), str(size)],
                         env=env, capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[-1])


def epoch_seconds(args, served_url: str | None) -> list[dict]:
    """The no-argument run for ``args.epochs`` epochs (toy_geneval through ``served_url`` if
    given): ``time/epoch_s`` and ``time/reward_s`` of each epoch after the first."""
    extra = ["--reward_options", json.dumps({"toy_geneval": {"service": served_url}})] if served_url else []
    with tempfile.TemporaryDirectory(prefix="bench-reward-service-") as out_dir:
        command = [sys.executable, os.path.join(ROOT, "train_genrl.py"), "--num_epochs", str(args.epochs),
                   "--output_dir", out_dir, "--report_to", "none", *(QUICK_EPOCH if args.quick else []), *extra]
        env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1")
        proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"train_genrl.py exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
        with open(os.path.join(out_dir, "logs", "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
    return [{"epoch_s": r["time/epoch_s"], "reward_s": r["time/reward_s"]} for r in records if "time/epoch_s" in r][1:]


def compare_epochs(args) -> list[dict]:
    """``--epoch``: in-process and served runs, alternating ``args.rounds`` times; their epochs,
    medians and the served / in-process ratio of the median epoch."""
    common.print_machine(common.resolve_device(args.device), note=args.note)  # where the trainer runs
    proc, url, startup_s = start_service(args, args.port or common.free_port(), rewards="toy_geneval")
    epochs = {"inproc": [], "served": []}
    try:
        emit({"bench": "reward_service", "figure": "startup", "startup_s": startup_s})
        for round_ in range(args.rounds):
            for mode in ("inproc", "served"):
                for i, row in enumerate(epoch_seconds(args, url if mode == "served" else None), start=2):
                    epochs[mode].append(emit({"bench": "reward_service", "figure": "epoch", "mode": mode,
                                              "round": round_, "epoch": i, **row}))
    finally:
        stop_service(proc)
    rows = [{"mode": mode, "epochs": len(rows), **{k: statistics.median(r[k] for r in rows) for k in ("epoch_s", "reward_s")}}
            for mode, rows in epochs.items()]
    emit({"bench": "reward_service", "figure": "epoch_median", "setting": "quick" if args.quick else "no-argument run",
          "inproc_epoch_s": rows[0]["epoch_s"], "served_epoch_s": rows[1]["epoch_s"],
          "served_over_inproc": rows[1]["epoch_s"] / rows[0]["epoch_s"], "goal": 1.05})
    common.print_table(rows, ["mode", "epochs", "epoch_s", "reward_s"], title="No-argument run, toy_geneval (median seconds per epoch)")
    return rows


def main(args) -> list[dict]:
    if args.epoch:
        return compare_epochs(args)
    from genrl.rewards import build_reward_fn
    from genrl.rewards.service import encode_request

    device = common.setup(args)
    options = json.loads(args.reward_options) if args.reward_options else {}
    names = [n.strip() for n in args.rewards.split(",") if n.strip()]
    proc, url, startup_s = start_service(args, args.port or common.free_port())
    rows = []
    try:
        emit({"bench": "reward_service", "figure": "startup", "startup_s": startup_s})
        client_options = {name: {"service": url} for name in names}
        local = build_reward_fn(args.rewards, device=device, options=options)
        served = build_reward_fn(args.rewards, options=client_options)
        for n in args.batch_sizes:
            samples, prompts = toy_clips(n, 1, args.image_size, args.image_size)
            served(samples, prompts)  # warm: the replica's first call
            times = time_interleaved({
                "inproc": lambda: local(samples, prompts), "served": lambda: served(samples, prompts),
                "encode": lambda: encode_request(samples, prompts, None, names),
            }, device, args.repeats)
            rows.append(emit({
                "bench": "reward_service", "figure": "batch", "rewards": args.rewards, "samples": n,
                "image_size": args.image_size, "inproc_s": times["inproc"], "served_s": times["served"],
                "encode_s": times["encode"], "inproc_samples_per_s": n / times["inproc"],
                "served_samples_per_s": n / times["served"], "overhead": times["served"] / times["inproc"] - 1,
                "repeats": args.repeats,
            }))
        n = args.batch_sizes[-1]
        samples, prompts = toy_clips(n, 1, args.image_size, args.image_size)
        with ThreadPoolExecutor(args.clients) as pool:
            start = time.perf_counter()
            list(pool.map(lambda _: served(samples, prompts), range(args.clients * args.repeats)))
            elapsed = time.perf_counter() - start
        emit({"bench": "reward_service", "figure": "clients", "clients": args.clients, "samples": n,
              "served_samples_per_s": n * args.clients * args.repeats / elapsed})
        size = args.image_size
        emit({"bench": "reward_service", "figure": "memory", "rewards": args.rewards,
              "rss_inproc_mb": resident_mb(args.rewards, options, 2, size),
              "rss_client_mb": resident_mb(args.rewards, client_options, 2, size)})
    finally:
        stop_service(proc)
    common.print_table(rows, ["samples", "inproc_s", "served_s", "encode_s", "overhead"],
                       title="Reward service (median seconds per batch)")
    return rows


if __name__ == "__main__":
    main(parse_args())
