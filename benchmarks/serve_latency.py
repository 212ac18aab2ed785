"""Latency and throughput of the policy server, through openpi's client, against the policy alone.

    python benchmarks/serve_latency.py [--requests 200] [HYDRA_OVERRIDES ...]        # tiny policy, CPU
    python benchmarks/serve_latency.py policy=base precision=bf16                    # on a GPU

A policy of the configured size with random weights is exported to a temporary file and served by
``python -m slurmvla.serve`` in its own process. openpi's ``WebsocketClientPolicy`` sends DROID
observations (two 224x224 images, 7 joints, gripper, prompt) from 1 and then 4 client threads.
Reported: p50 / p99 latency per request, requests/s, and the policy alone (``sample_actions`` on
the same prepared batch, in this process) as the reference: server p50 / policy p50 is the
overhead of the wire, the mapping and image preparation. Needs openpi-client
(``pip install --no-deps openpi-client``).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from slurmvla.compose import compose
from slurmvla.engine.materialize import place
from slurmvla.inference.build import build_runner
from slurmvla.policy import build_policy


def observation(seed: int) -> dict:
    g = np.random.default_rng(seed)
    return {
        "observation/exterior_image_1_left": g.integers(0, 256, (224, 224, 3), dtype=np.uint8),
        "observation/wrist_image_left": g.integers(0, 256, (224, 224, 3), dtype=np.uint8),
        "observation/joint_position": g.normal(size=7),
        "observation/gripper_position": g.uniform(size=1),
        "prompt": "put the marker in the cup",
    }


def start_server(source: Path, threads: int, *args: str) -> tuple[subprocess.Popen, int]:
    """``python -m slurmvla.serve SOURCE`` on a free port of 127.0.0.1 with ``threads`` torch threads; returns
    its process and port once it listens (its output drained meanwhile). Stop it by its PID."""
    proc = subprocess.Popen([sys.executable, "-m", "slurmvla.serve", str(source), "--host", "127.0.0.1", "--port", "0",
                             *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    lines = []
    for line in proc.stdout:
        lines.append(line)
        m = re.search(r"on ws://127\.0\.0\.1:(\d+)", line)
        if m:
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, int(m.group(1))
    proc.wait(15)
    raise SystemExit("the server did not start:\n" + "".join(lines)[-3000:])


def export_random(cfg, device: str) -> tuple[Path, int]:
    """The configured policy with random weights (seed 0), exported to a temporary file as
    ``python -m slurmvla.export`` writes one; returns the file and the parameter count."""
    source = Path(tempfile.mkdtemp(prefix="slurmvla-serve-bench-")) / "policy.safetensors"
    torch.manual_seed(0)
    # Built where it runs, no fp32 copy on the host first (the full sizes on a GPU), when the policy can be.
    policy = place(build_policy(cfg.policy, on_meta=True), torch.device(device))
    yaml = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    save_file({k: v.contiguous() for k, v in policy.state_dict().items()}, str(source),
              metadata={"config_yaml": yaml, "step": "0", "engine": "none"})
    return source, sum(p.numel() for p in policy.parameters())


def percentiles(ms: list[float]) -> tuple[float, float]:
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99))


def clients(port: int, num_clients: int, requests: int) -> tuple[list[float], float]:
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    conns = [WebsocketClientPolicy("127.0.0.1", port) for _ in range(num_clients)]
    for c in conns:  # warm-up
        c.infer(observation(0))
    latencies: list[list[float]] = [[] for _ in conns]

    def run(i: int) -> None:
        obs = observation(i)
        for _ in range(requests // num_clients):
            t0 = time.perf_counter()
            conns[i].infer(obs)
            latencies[i].append((time.perf_counter() - t0) * 1000)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(num_clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    flat = [x for lat in latencies for x in lat]
    return flat, len(flat) / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads, for the policy alone and the server alike (default 1: on a small "
                             "machine the client processes need the other cores)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    torch.set_num_threads(args.threads)
    cfg = compose(args.overrides)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    source, params = export_random(cfg, device)
    # The reference: the policy alone on the batch the server would build, in this process, loaded as the
    # server loads it (its device, bf16 weights under precision=bf16 on a GPU).
    runner = build_runner(str(source), [], device=device)
    past = collections.deque([runner.processor.read(observation(0))], maxlen=1)
    batch = runner.processor.batch(past)
    alone = []
    for i in range(min(args.requests, 100) + 5):
        t0 = time.perf_counter()
        runner.act(batch)
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 5:
            alone.append((time.perf_counter() - t0) * 1000)

    proc, port = start_server(source, args.threads)
    try:
        rows = [("policy alone (in process)", *percentiles(alone), 1000 / statistics.median(alone))]
        for n in (1, 4):
            lat, rps = clients(port, n, args.requests)
            rows.append((f"server, {n} client{'s' if n > 1 else ''}", *percentiles(lat), rps))
    finally:
        proc.terminate()
        proc.wait(15)
    print(f"policy {cfg.policy.name} ({params / 1e6:.2f} M parameters), {cfg.precision}, {device}, "
          f"{cfg.policy.num_inference_steps} denoising steps, {args.requests} requests per row, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'':28s} {'p50 ms':>8s} {'p99 ms':>8s} {'req/s':>8s}")
    for name, p50, p99, rps in rows:
        print(f"{name:28s} {p50:8.2f} {p99:8.2f} {rps:8.1f}")
    base = rows[0][1]
    print(f"server p50 / policy p50: 1 client {rows[1][1] / base:.2f}, 4 clients {rows[2][1] / base:.2f}; "
          f"throughput 4 clients / 1 client {rows[2][3] / rows[1][3]:.2f}")


if __name__ == "__main__":
    main()
