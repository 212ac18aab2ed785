"""The policy server under N concurrent clients: latency, throughput, lost and out-of-order replies, memory.

    python benchmarks/serve_load.py [--clients 1 4 16] [--requests-per-client 50] [--seconds 60] [OVERRIDES ...]
    python benchmarks/serve_load.py --soak 10000 [--soak-clients 4]       # memory over 10k requests
    python benchmarks/serve_load.py --source RUN_DIR                      # a trained policy instead

One server (``python -m slurmvla.serve`` in its own process, stopped by its PID) serves a policy of the
configured size with random weights, exported as ``python -m slurmvla.export`` writes one (serve_latency.py
does the same), or ``--source``. For each N, N clients, each openpi's published ``WebsocketClientPolicy`` in
its own thread, connect, start together and send ``--requests-per-client`` DROID observations each (two
224x224 images, 7 joints, gripper, prompt), stopping early after ``--seconds``. Each client cycles through 4
observations of its own, so a reply that answers another request than the one just sent is seen.

Every reply is checked against the policy run in this process on that observation alone (``serve.seed``
fixes the noise, so the same observation gives the same chunk): ``lost`` counts requests sent without a
reply, ``out-of-order`` replies that equal the chunk of another of the client's observations, ``wrong``
replies that equal none of them (a policy with observation history is not checked: its chunks depend on the
connection's past). Latency is per request at the client (send to reply), pooled over the clients: p50, p99,
and the worst client's p99. The server's RSS before and after each N (psutil).

``--soak N``: N requests spread over ``--soak-clients`` clients, each opening a new connection every
``--soak-reconnect`` requests (a session per connection is made and dropped), the server's RSS, anonymous RSS
(heap: where a leak grows) and USS sampled about 40 times on the way; flat when the median of the last quarter
of the samples is within 2 % (or 8 MiB) of the first quarter's. USS also moves as other processes start and
end sharing the server's libraries (on a shared machine, by several MiB), RSS and anonymous RSS do not.

The client threads share this process's interpreter (and, on a small machine, the server's cores): on a
2-core CPU the figures are the machine's, not the server's alone.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_latency import export_random, observation, start_server  # noqa: E402

from slurmvla.compose import compose  # noqa: E402
from slurmvla.inference.build import build_runner  # noqa: E402

MiB = 2**20
PER_CLIENT = 4  # distinct observations each client cycles through
RTOL, ATOL = 1e-4, 1e-5  # the same fp32 work in two processes: a few ulp apart


@dataclass
class Client:
    index: int
    latencies_ms: list[float] = field(default_factory=list)
    replies: list[np.ndarray] = field(default_factory=list)  # actions, in the order received
    sent: int = 0
    error: str | None = None
    refused: bool = False  # its connection (503) or a request (serve.max_pending) was refused


def seed_of(client: int, k: int) -> int:
    return 1000 + client * PER_CLIENT + k


def run_clients(port: int, n: int, requests: int, seconds: float, progress: list[int] | None = None,
                reconnect_every: int = 0) -> tuple[list[Client], float]:
    """``n`` openpi clients in threads, connected first, then started together; each sends up to ``requests``
    observations or stops after ``seconds`` (``reconnect_every`` > 0: a new connection after that many).
    Returns the clients and the wall time of the sending."""
    import websockets
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    clients = [Client(i) for i in range(n)]
    conns = []
    for c in clients:
        try:
            conns.append(WebsocketClientPolicy("127.0.0.1", port))
        except websockets.exceptions.InvalidStatus as e:  # over serve.max_connections: 503, counted as refused
            conns.append(None)
            c.refused = True
            c.error = f"refused: HTTP {e.response.status_code} {bytes(e.response.body).decode().strip()}"
    observations = [[observation(seed_of(i, k)) for k in range(PER_CLIENT)] for i in range(n)]
    start = threading.Barrier(n + 1)
    lock = threading.Lock()

    def run(c: Client) -> None:
        start.wait()
        if conns[c.index] is None:
            return
        deadline = time.perf_counter() + seconds
        try:
            for r in range(requests):
                if time.perf_counter() > deadline:
                    break
                if reconnect_every and r and r % reconnect_every == 0:
                    conns[c.index]._ws.close()
                    conns[c.index] = WebsocketClientPolicy("127.0.0.1", port)
                c.sent += 1
                t0 = time.perf_counter()
                reply = conns[c.index].infer(observations[c.index][r % PER_CLIENT])
                c.latencies_ms.append((time.perf_counter() - t0) * 1000)
                c.replies.append(np.asarray(reply["actions"]))
                if progress is not None:
                    with lock:
                        progress[0] += 1
        except Exception as e:  # noqa: BLE001 - counted and reported in the table
            c.error = f"{type(e).__name__}: {e}"
            c.refused = "server busy" in str(e)  # over serve.max_pending: an explicit answer, not a lost request

    threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in clients]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for conn in filter(None, conns):
        conn._ws.close()  # openpi's client has no close of its own
    return clients, wall


def check(clients: list[Client], references: dict[int, np.ndarray] | None) -> dict:
    """lost / out-of-order / wrong, each reply against the client's own observations' chunks."""
    lost = sum(c.sent - len(c.replies) for c in clients if not c.refused)
    if references is None:
        return {"lost": lost, "out_of_order": None, "wrong": None}
    out_of_order = wrong = 0
    for c in clients:
        own = [references[seed_of(c.index, k)] for k in range(PER_CLIENT)]
        for r, got in enumerate(c.replies):
            if np.allclose(got, own[r % PER_CLIENT], rtol=RTOL, atol=ATOL):
                continue
            if any(np.allclose(got, ref, rtol=RTOL, atol=ATOL) for ref in own):
                out_of_order += 1
            else:
                wrong += 1
    return {"lost": lost, "out_of_order": out_of_order, "wrong": wrong}


def memory(pid: int) -> tuple[int, int, int]:
    """The server's RSS, anonymous RSS (its heap and stacks: where a leak grows; Linux's RssAnon) and USS (its
    pages no other process maps, which also moves as other processes start and end sharing its libraries),
    bytes."""
    info = psutil.Process(pid).memory_full_info()
    anon = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                anon = int(line.split()[1]) * 1024
    return info.rss, anon, info.uss


def soak(port: int, pid: int, total: int, n: int, seconds: float, reconnect_every: int) -> None:
    progress = [0]
    samples: list[tuple[int, float, int, int, int]] = []  # (replies so far, seconds, rss, anon, uss)
    done = threading.Event()
    t0 = time.perf_counter()
    interval = 0.5

    def sample() -> None:
        step = max(1, total // 40)
        next_at = 0
        while not done.is_set():
            if progress[0] >= next_at:
                samples.append((progress[0], time.perf_counter() - t0, *memory(pid)))
                next_at = progress[0] + step
            done.wait(interval)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    clients, wall = run_clients(port, n, total // n, seconds, progress, reconnect_every)
    done.set()
    sampler.join()
    samples.append((progress[0], time.perf_counter() - t0, *memory(pid)))
    replies = sum(len(c.replies) for c in clients)
    lost = sum(c.sent - len(c.replies) for c in clients if not c.refused)
    connections = n * -(-(total // n) // reconnect_every) if reconnect_every else n
    print(f"soak: {replies} requests over {n} clients ({connections} connections) in {wall:.0f} s "
          f"({replies / wall:.1f} req/s), lost {lost}, {len(samples)} memory samples")
    print(f"{'requests':>9s} {'s':>7s} {'RSS MiB':>9s} {'anon MiB':>9s} {'USS MiB':>9s}")
    for i in np.linspace(0, len(samples) - 1, min(len(samples), 9)).round().astype(int):
        done_n, s, rss, anon, uss = samples[i]
        print(f"{done_n:9d} {s:7.1f} {rss / MiB:9.1f} {anon / MiB:9.1f} {uss / MiB:9.1f}")
    q = max(1, len(samples) // 4)
    verdicts = []
    for name, col in (("RSS", 2), ("anon RSS", 3), ("USS", 4)):
        first = np.median([x[col] for x in samples[:q]])
        last = np.median([x[col] for x in samples[-q:]])
        flat = abs(last - first) <= max(0.02 * first, 8 * MiB)
        verdicts.append(f"{name} median of the first quarter {first / MiB:.1f} MiB, of the last {last / MiB:.1f} MiB "
                        f"({(last - first) / MiB:+.1f} MiB): {'flat' if flat else 'NOT flat'}")
    print("; ".join(verdicts))
    for c in clients:
        if c.error:
            print(f"  client {c.index}: {c.error}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests-per-client", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=60.0, help="each N's clients stop sending after this long")
    parser.add_argument("--soak", type=int, default=0, help="instead: this many requests, the server's memory sampled")
    parser.add_argument("--soak-clients", type=int, default=4)
    parser.add_argument("--soak-seconds", type=float, default=1800.0)
    parser.add_argument("--soak-reconnect", type=int, default=100,
                        help="each soak client opens a new connection after this many requests (0: never)")
    parser.add_argument("--source", help="serve this (a run directory, a checkpoint, an exported file) instead")
    parser.add_argument("--serve-args", default="", help="more arguments for python -m slurmvla.serve, e.g. "
                                                         "'--max-connections 4'")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads, here and in the server")
    parser.add_argument("overrides", nargs="*", help="config overrides of the random policy, e.g. policy=small")
    args = parser.parse_intermixed_args()
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.source:
        source, what = Path(args.source), args.source
    else:
        cfg = compose(args.overrides)
        source, params = export_random(cfg, device)
        what = f"{cfg.policy.name} with random weights ({params / 1e6:.2f} M parameters)"
    runner = build_runner(str(source), [], device=device)
    pc = runner.cfg.policy
    print(f"policy {what}, {runner.cfg.precision}, {device}, {pc.num_inference_steps} denoising steps; "
          f"torch threads {torch.get_num_threads()}; {psutil.cpu_count()} CPUs; client threads in one process")

    proc, port = start_server(source, args.threads, *args.serve_args.split())
    try:
        run_clients(port, 1, PER_CLIENT, args.seconds)  # warm-up: the server's first requests allocate
        if args.soak:
            soak(port, proc.pid, args.soak, args.soak_clients, args.soak_seconds, args.soak_reconnect)
            return
        history = runner.processor.history > 1
        references = None if history else {
            seed_of(i, k): runner.infer(observation(seed_of(i, k)))["actions"]
            for i in range(max(args.clients)) for k in range(PER_CLIENT)}
        print(f"{args.requests_per_client} requests per client (at most {args.seconds:g} s per N)")
        print(f"{'N':>3s} {'p50 ms':>8s} {'p99 ms':>8s} {'worst p99':>9s} {'req/s':>7s} {'replies':>7s} {'lost':>5s} "
              f"{'out-of-order':>12s} {'wrong':>5s} {'refused':>7s} {'RSS before':>10s} {'RSS after':>10s}")
        for n in args.clients:
            before = memory(proc.pid)[0]
            clients, wall = run_clients(port, n, args.requests_per_client, args.seconds)
            after = memory(proc.pid)[0]
            result = check(clients, references)
            pooled = [x for c in clients for x in c.latencies_ms]
            replies = len(pooled)
            p50, p99 = np.percentile(pooled, [50, 99]) if pooled else (float("nan"),) * 2
            worst = max((np.percentile(c.latencies_ms, 99) for c in clients if c.latencies_ms), default=float("nan"))
            ooo = "n/a" if result["out_of_order"] is None else str(result["out_of_order"])
            wrong = "n/a" if result["wrong"] is None else str(result["wrong"])
            print(f"{n:3d} {p50:8.1f} {p99:8.1f} {worst:9.1f} {replies / wall:7.1f} {replies:7d} {result['lost']:5d} "
                  f"{ooo:>12s} {wrong:>5s} {sum(c.refused for c in clients):7d} {before / MiB:7.1f} MiB "
                  f"{after / MiB:6.1f} MiB")
            errors = sorted({c.error for c in clients if c.error})
            for error in errors:
                print(f"    {sum(c.error == error for c in clients)} client(s): {error}")
        if history:
            print("(a policy with observation history: replies not checked against the policy alone)")
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except Exception:  # noqa: BLE001 - a server that ignores SIGTERM is killed, by its PID
            proc.kill()
            proc.wait(5)


if __name__ == "__main__":
    main()
