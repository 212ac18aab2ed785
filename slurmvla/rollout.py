"""Closed loop: a policy drives the simulated arm (:mod:`slurmvla.sim`) through openpi's client, and the
success rate is the metric.

    python -m slurmvla.rollout SOURCE [overrides ...]            # starts the policy server itself
    python -m slurmvla.rollout ws://HOST:PORT [overrides ...]    # a running python -m slurmvla.serve

``SOURCE`` is what ``python -m slurmvla.serve`` takes (a run directory, a checkpoint folder, an exported
file); the server then runs in this process on 127.0.0.1 with a free port. Either way the episodes
talk to it through openpi's published ``openpi_client.WebsocketClientPolicy``, as a robot would: each
request is the observation under openpi's DROID keys (the cameras and state the server's metadata
names, and the prompt), each reply an action chunk, of which ``rollout.replan_steps`` actions are
executed before the next request (open loop in between, as openpi's clients do).

Episode ``e`` is the environment's seed ``rollout.first_seed + e`` (``rollout.episodes`` of them; the
demonstrations use 0..N-1, the default first seed none of them). Per episode: success, return (the
dense progress reward, in [0, 1] per step, summed over ``rollout.max_steps`` with success absorbing:
the steps after it count 1 each), length. Overall: ``rollout/success_rate`` with its 95 % Wilson interval,
mean return and length, wall time, control steps and requests per second. Written to
``rollout.out`` (default ``RUN_DIR/rollout/step_N/``): ``rollout.json`` (the summary and every
episode) and ``episode_SEED.mp4`` for the first ``rollout.videos`` episodes (exterior and wrist
cameras side by side). ``--shard I/N`` runs every N-th episode from the I-th (``sbatch/rollout.sh``
runs N such clients and merges their files with ``--merge``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from slurmvla.compose import ArgumentParser
from slurmvla.config import RolloutConfig

log = logging.getLogger("slurmvla.rollout")

INSTALL = "pip install -e '.[sim]' (bash scripts/install.sh sim)"
# The state the simulator sends, under openpi's DROID keys.
STATE_KEYS = ("observation/joint_position", "observation/gripper_position")


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The 95 % Wilson score interval of a success rate (sound at 0 and n, unlike the normal one)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def summarize(episodes: list[dict], wall_s: float) -> dict:
    """The metrics of a set of episodes (``rollout/*``) with the episodes themselves."""
    n = len(episodes)
    wins = sum(e["success"] for e in episodes)
    lo, hi = wilson_interval(wins, n)
    steps = sum(e["length"] for e in episodes)
    requests = sum(e["requests"] for e in episodes)
    return {
        "rollout/success_rate": wins / max(n, 1), "rollout/success_ci95_low": lo, "rollout/success_ci95_high": hi,
        "rollout/episodes": n, "rollout/successes": wins,
        "rollout/mean_return": float(np.mean([e["return"] for e in episodes])) if n else 0.0,
        "rollout/mean_length": steps / max(n, 1),
        "rollout/wall_s": wall_s, "rollout/steps_per_s": steps / max(wall_s, 1e-9),
        "rollout/requests_per_s": requests / max(wall_s, 1e-9),
        "episodes": sorted(episodes, key=lambda e: e["seed"]),
    }


def require_sim() -> None:
    """A ValueError naming the extra when the simulator or openpi's client is not installed."""
    _need("slurmvla.sim.env")
    _need("openpi_client.websocket_client_policy")


def _need(module: str):  # noqa: ANN202
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as e:
        raise ValueError(f"the closed loop needs {module} ({e}); {INSTALL}") from None


def run_episodes(client: Any, cfg: RolloutConfig, seeds: list[int], video_dir: Path | None = None) -> list[dict]:
    """Run one episode per seed against ``client`` (anything with openpi's ``infer(obs) -> {"actions"}``
    and ``get_server_metadata()``); returns one dict per episode."""
    from slurmvla.data.writer import encode_video
    from slurmvla.sim.env import CLIENT_CAMERAS, PickCube
    from slurmvla.sim.record import INSTRUCTIONS

    metadata = client.get_server_metadata() or {}
    wanted = [k for k in (metadata.get("cameras") or {}).values() if k]
    unknown = [k for k in wanted if k not in CLIENT_CAMERAS]
    if unknown or not wanted:
        raise ValueError(f"the server asks for cameras {wanted}; the simulator sends {list(CLIENT_CAMERAS)} "
                         "(set serve.cameras to those keys)")
    state_keys = metadata.get("state") or list(STATE_KEYS)
    if [k for k in state_keys if k not in STATE_KEYS]:
        raise ValueError(f"the server asks for state keys {state_keys}; the simulator sends {list(STATE_KEYS)} "
                         "(set serve.state to those keys)")
    prompt_key = metadata.get("prompt") or "prompt"
    horizon = int(metadata.get("action_horizon") or cfg.replan_steps)
    replan = min(cfg.replan_steps, horizon)
    if cfg.replan_steps > horizon:
        log.warning("rollout.replan_steps=%d is more than the policy's action_horizon=%d: replanning every %d",
                    cfg.replan_steps, horizon, horizon)
    video_keys = ["observation/exterior_image_1_left", "observation/wrist_image_left"]
    env = PickCube(height=cfg.height, width=cfg.width, cameras=tuple(CLIENT_CAMERAS.values()))
    results = []
    try:
        for i, seed in enumerate(seeds):
            env.reset(seed)
            plan: list[np.ndarray] = []
            total, requests, success, frames = 0.0, 0, False, []
            record = video_dir is not None and i < cfg.videos
            start = time.perf_counter()
            for _ in range(cfg.max_steps):
                if not plan or record:
                    obs = env.observe(tuple(dict.fromkeys(wanted + (video_keys if record else []))))
                    if record:
                        frames.append(np.concatenate([obs[k] for k in video_keys], axis=1))
                if not plan:
                    request = {k: obs[k] for k in wanted}
                    request.update({k: obs[k] for k in state_keys})
                    request[prompt_key] = INSTRUCTIONS[0]
                    actions = np.asarray(client.infer(request)["actions"], dtype=np.float64)
                    requests += 1
                    if actions.ndim != 2 or actions.shape[1] != 8:
                        raise ValueError(f"the server returned actions of shape {actions.shape}; the simulator acts in "
                                         "DROID's space: [horizon, 8] (7 joint velocities, gripper position)")
                    plan = list(actions[:replan])
                step = env.step(plan.pop(0))
                total += step.reward
                if step.success:
                    success = True
                    # Success is absorbing: the steps left count at the full reward, so a quick success
                    # never returns less than a slow one or a near miss.
                    total += float(cfg.max_steps - env.steps)
                    break
            result = {"seed": int(seed), "success": success, "return": total, "length": env.steps, "requests": requests,
                      "wall_s": time.perf_counter() - start}
            if record and frames:
                path = video_dir / f"episode_{seed}.mp4"
                encode_video(path, np.stack(frames), codec="h264")
                result["video"] = path.name
            results.append(result)
            log.info("episode seed %d: %s in %d steps (return %.2f)", seed, "success" if success else "failure",
                     env.steps, total)
    finally:
        env.close()
    return results


def connect(host: str, port: int, api_key: str | None = None, timeout_s: float = 120.0) -> Any:
    """openpi's client, once the address accepts connections (openpi's own client would wait forever
    for a wrong address)."""
    client_module = _need("openpi_client.websocket_client_policy")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=min(5.0, timeout_s)).close()
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise ValueError(f"cannot reach ws://{host}:{port} within {timeout_s:g} s ({e}); is the server running "
                                 "there (python -m slurmvla.serve)? rollout.connect_timeout_s waits longer") from None
            time.sleep(0.5)
    return client_module.WebsocketClientPolicy(host=host, port=port, api_key=api_key)


def run_served(server: Any, cfg: RolloutConfig, seeds: list[int], video_dir: Path | None) -> list[dict]:
    """Episodes against a :class:`slurmvla.serve.PolicyServer` run in this process (on 127.0.0.1),
    through openpi's client as against any other server."""
    from slurmvla.serve import serving_in_thread

    with serving_in_thread(server) as port:
        client = connect("127.0.0.1", port)
        try:
            return run_episodes(client, cfg, seeds, video_dir)
        finally:
            _close(client)


def in_training(policy: Any, cfg: Any, step: int, run_dir: Path, rank: int, world_size: int) -> dict | None:
    """The trainer's periodic closed loop (``trainer.rollout_every_steps``): this rank's share of the
    episodes against its copy of ``policy``; every rank calls it. Rank 0 gets the metrics of all
    episodes (and writes ``run_dir/rollout/step_N/``); the other ranks get None."""
    from slurmvla.collectives import gather_objects
    from slurmvla.export import Loaded
    from slurmvla.serve import PolicyRunner, PolicyServer

    rcfg = cfg.rollout
    out = Path(rcfg.out) / f"step_{step:08d}" if rcfg.out else Path(run_dir) / "rollout" / f"step_{step:08d}"
    start = time.perf_counter()
    server = PolicyServer(PolicyRunner(Loaded(policy, cfg, step, str(run_dir))), "127.0.0.1", 0)
    mine = run_served(server, rcfg, _seeds(rcfg, (rank, world_size)), out if rank == 0 else None)
    everyone = gather_objects(mine)
    if rank != 0:
        return None
    summary = summarize([e for part in everyone for e in part], time.perf_counter() - start)
    summary.update({"source": str(run_dir), "step": step, "replan_steps": rcfg.replan_steps, "max_steps": rcfg.max_steps})
    out.mkdir(parents=True, exist_ok=True)
    (out / "rollout.json").write_text(json.dumps(summary, indent=1))
    return {k: float(v) for k, v in summary.items() if k.startswith("rollout/")}


def _close(client: Any) -> None:
    ws = getattr(client, "_ws", None)
    if ws is not None:
        ws.close()


def _seeds(cfg: RolloutConfig, shard: tuple[int, int]) -> list[int]:
    index, count = shard
    return [cfg.first_seed + e for e in range(cfg.episodes) if e % count == index]


def _parse_shard(text: str) -> tuple[int, int]:
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard {text!r} is not I/N (e.g. 0/4)") from None
    if not 0 <= index < count:
        raise ValueError(f"--shard {text!r}: I must be in 0..N-1")
    return index, count


def _rollout_config(overrides: list[str]) -> RolloutConfig:
    """rollout.* overrides for a server address (no run config to apply them to)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    base = OmegaConf.structured(RolloutConfig)
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key.startswith("rollout."):
            raise ValueError(f"{item!r}: against a server address only rollout.* overrides apply (the policy's "
                             "config is the server's), e.g. rollout.episodes=20")
        if key.removeprefix("rollout.") not in base:
            raise ValueError(f"{key} is not a setting; choose from {sorted(base)}")
    try:
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist([o.removeprefix("rollout.") for o in overrides]))
    except OmegaConfBaseException as e:
        raise ValueError(str(e)) from None
    return OmegaConf.to_object(merged)


def run(source: str, overrides: list[str], shard: tuple[int, int] | None = None, api_key: str | None = None) -> dict:
    """The episodes of ``source`` (a run, checkpoint or exported file, or ``ws://host:port``); writes and
    returns the summary (``rollout.json``, or ``rollout_shardIofN.json`` for a ``shard`` (I, N))."""
    name = "rollout.json" if shard is None else f"rollout_shard{shard[0]}of{shard[1]}.json"
    shard = shard or (0, 1)
    require_sim()
    if source.startswith(("ws://", "wss://")):
        host, _, port = source.split("://", 1)[1].rstrip("/").rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{source!r} is not a server address; write it as ws://HOST:PORT")
        cfg = _rollout_config(overrides)
        out = Path(cfg.out or "rollout")
        seeds = _seeds(cfg, shard)
        start = time.perf_counter()
        client = connect(host, int(port), api_key, cfg.connect_timeout_s)
        try:
            episodes = run_episodes(client, cfg, seeds, out)
        finally:
            _close(client)
        step, where = None, source
    else:
        from slurmvla.serve import build_server

        # On the loopback interface, with no API key: only this process talks to it.
        server = build_server(source, [*overrides, "serve.host=127.0.0.1", "serve.port=0"], environ={})
        loaded = server.runner.loaded
        cfg = loaded.cfg.rollout
        step, where = loaded.step, loaded.source
        out = Path(cfg.out) if cfg.out else _default_out(Path(source), step)
        seeds = _seeds(cfg, shard)
        start = time.perf_counter()
        episodes = run_served(server, cfg, seeds, out)
    summary = summarize(episodes, time.perf_counter() - start)
    summary.update({"source": where, "step": step, "replan_steps": cfg.replan_steps, "max_steps": cfg.max_steps,
                    "shard": f"{shard[0]}/{shard[1]}", "host": socket.gethostname()})
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(summary, indent=1))
    return summary | {"out": str(out / name)}


def _default_out(source: Path, step: int) -> Path:
    run_dir = source if (source / "config.resolved.yaml").is_file() else None
    if run_dir is None and source.is_dir() and (source.parent.parent / "config.resolved.yaml").is_file():
        run_dir = source.parent.parent
    base = run_dir if run_dir is not None else (source.parent if source.is_file() else source)
    return base / "rollout" / f"step_{step:08d}"


def merge(paths: list[Path], out: Path) -> dict:
    """One summary from the shards' files (``sbatch/rollout.sh``)."""
    parts = []
    for p in paths:
        try:
            parts.append(json.loads(Path(p).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{p}: not a rollout summary ({e})") from None
    episodes = [e for part in parts for e in part["episodes"]]
    wall = max(part["rollout/wall_s"] for part in parts)
    summary = summarize(episodes, wall)
    summary.update({k: parts[0][k] for k in ("source", "step", "replan_steps", "max_steps") if k in parts[0]})
    summary["shards"] = len(parts)
    summary["hosts"] = sorted({part.get("host", "?") for part in parts})
    out.write_text(json.dumps(summary, indent=1))
    return summary | {"out": str(out)}


def _line(summary: dict) -> str:
    return (f"success rate {summary['rollout/success_rate']:.3f} ({summary['rollout/successes']}/"
            f"{summary['rollout/episodes']}; 95% CI {summary['rollout/success_ci95_low']:.3f}-"
            f"{summary['rollout/success_ci95_high']:.3f}), mean return {summary['rollout/mean_return']:.2f}, mean length "
            f"{summary['rollout/mean_length']:.1f} steps, {summary['rollout/wall_s']:.1f} s "
            f"({summary['rollout/steps_per_s']:.1f} steps/s, {summary['rollout/requests_per_s']:.1f} requests/s): "
            f"{summary['out']}")


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", nargs="?", help="a run directory, checkpoint folder or exported file, or ws://HOST:PORT")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. rollout.episodes=50 rollout.replan_steps=8")
    parser.add_argument("--shard", help="I/N: run every N-th episode from the I-th, into rollout_shardIofN.json "
                                         "(default: all, into rollout.json)")
    parser.add_argument("--api-key-env", default="SLURMVLA_API_KEY",
                        help="environment variable holding the server's API key, if it has one (default SLURMVLA_API_KEY)")
    parser.add_argument("--merge", nargs="+", metavar="SHARD_JSON", help="merge shard summaries into --out and exit")
    parser.add_argument("--out", help="with --merge: the merged summary's path")
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # PyOpenGL says at import that its optional accelerator is absent; websockets logs every connection.
    for noisy in ("OpenGL", "websockets"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    import os

    try:
        if args.merge:
            summary = merge([Path(p) for p in args.merge], Path(args.out or "rollout.json"))
        else:
            if not args.source:
                raise ValueError("give a SOURCE (run directory, checkpoint, exported file) or ws://HOST:PORT")
            shard = _parse_shard(args.shard) if args.shard else None
            summary = run(args.source, list(args.overrides), shard, os.environ.get(args.api_key_env))
    except ValueError as e:
        from slurmvla.serve import _one_line

        print(f"error: {_one_line(e)}", file=sys.stderr)
        sys.exit(2)
    print(_line(summary), flush=True)


if __name__ == "__main__":
    main()
