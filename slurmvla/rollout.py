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
``rollout.execution`` picks how chunks run (sync: ask and hold; async: ask while executing, then switch;
rtc: as async, the request carrying the old chunk and the delay) and ``rollout.delay_steps`` (or
``rollout.delay=measured``) how many control steps the environment advances while a request is outstanding.

Episode ``e`` is the environment's seed ``rollout.first_seed + e`` (``rollout.episodes`` of them; the
demonstrations use 0..N-1, the default first seed none of them). Per episode: success, return (the
dense progress reward, in [0, 1] per step, summed over ``rollout.max_steps`` with success absorbing:
the steps after it count 1 each), length. Overall: ``rollout/success_rate`` with its 95 % Wilson interval,
mean return and length, wall time, control steps and requests per second, the action jumps at chunk switches
and within chunks, the steps held. Written to
``--out DIR`` / ``rollout.out`` (default ``RUN_DIR/rollout/step_N/``, where the training's periodic evaluation
of step N goes too: a default folder that already holds a summary is refused, never overwritten):
``rollout.json`` (the summary and every episode) and ``episode_SEED.mp4`` for the first ``rollout.videos``
episodes (exterior and wrist cameras side by side). ``--shard I/N`` runs every N-th episode from the I-th
(``sbatch/rollout.sh`` runs N such clients and merges their files with ``--merge``).
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import time
from pathlib import Path

from slurmvla.cli import ArgumentParser, program
from slurmvla.config.rollout import RolloutConfig
from slurmvla.errors import boundary
from slurmvla.inference.closed_loop import (
    close_client,
    connect,
    execution_of,
    groups_of,
    history_warning,
    require_sim,
    run_episodes,
    run_served,
    shard_seeds,
    summarize,
)

log = logging.getLogger("slurmvla.rollout")


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


def run(source: str, overrides: list[str], shard: tuple[int, int] | None = None, api_key: str | None = None,
        out: str | None = None) -> dict:
    """The episodes of ``source`` (a run, checkpoint or exported file, or ``ws://host:port``); writes and
    returns the summary (``rollout.json``, or ``rollout_shardIofN.json`` for a ``shard`` (I, N)) into ``out``
    (else ``rollout.out``, else the default folder, which must not hold that summary already)."""
    name = "rollout.json" if shard is None else f"rollout_shard{shard[0]}of{shard[1]}.json"
    if out is not None:
        overrides = [*overrides, f"rollout.out={out}"]
    shard = shard or (0, 1)
    require_sim()
    if source.startswith(("ws://", "wss://")):
        host, _, port = source.split("://", 1)[1].rstrip("/").rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{source!r} is not a server address; write it as ws://HOST:PORT")
        cfg = _rollout_config(overrides)
        require_sim(cfg.env)
        out = Path(cfg.out) if cfg.out else _unused_default(Path("rollout"), name)
        seeds = shard_seeds(cfg, shard)
        start = time.perf_counter()
        client = connect(host, int(port), api_key, cfg.connect_timeout_s)
        try:
            episodes = run_episodes(client, cfg, seeds, out)
        finally:
            close_client(client)
        step, where, weights = None, source, None
    else:
        from slurmvla.inference.build import build_server

        # On the loopback interface, with no API key: only this process talks to it.
        server = build_server(source, [*overrides, "serve.host=127.0.0.1", "serve.port=0"], environ={})
        loaded = server.policy.loaded
        cfg = loaded.cfg.rollout
        require_sim(cfg.env)
        step, where, weights = loaded.step, loaded.source, loaded.weights
        if (warning := history_warning(loaded.cfg.data, loaded.cfg.serve, cfg.replan_steps)) is not None:
            log.warning(warning)
        out = Path(cfg.out) if cfg.out else _unused_default(_default_out(Path(source), step), name)
        seeds = shard_seeds(cfg, shard)
        start = time.perf_counter()
        episodes = run_served(server, cfg, seeds, out)
    summary = summarize(episodes, time.perf_counter() - start, groups_of(cfg))
    summary.update({"source": where, "step": step, "weights": weights, "max_steps": cfg.max_steps,
                    **execution_of(cfg), "shard": f"{shard[0]}/{shard[1]}", "host": socket.gethostname()})
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(summary, indent=1))
    return summary | {"out": str(out / name)}


def _default_out(source: Path, step: int) -> Path:
    run_dir = source if (source / "config.resolved.yaml").is_file() else None
    if run_dir is None and source.is_dir() and (source.parent.parent / "config.resolved.yaml").is_file():
        run_dir = source.parent.parent
    base = run_dir if run_dir is not None else (source.parent if source.is_file() else source)
    return base / "rollout" / f"step_{step:08d}"


def _unused_default(out: Path, name: str) -> Path:
    """``out`` unless it already holds a summary ``name``: the training's periodic evaluation of the same step
    (``trainer.rollout_every_steps`` writes there too) or an earlier rollout, which a default never replaces."""
    if (out / name).is_file():
        raise ValueError(f"{out / name} already holds an evaluation (the training's periodic one of this step, or an "
                         "earlier rollout), which this one would replace: give it a folder of its own with --out DIR "
                         "(or rollout.out=DIR)")
    return out


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
    summary = summarize(episodes, wall, _groups(parts[0].get("env")))
    summary.update({k: parts[0][k] for k in ("source", "step", "max_steps", "env", "task", "execution", "delay")
                    if k in parts[0]})
    summary["shards"] = len(parts)
    summary["hosts"] = sorted({part.get("host", "?") for part in parts})
    out.write_text(json.dumps(summary, indent=1))
    return summary | {"out": str(out)}


def _groups(env: str | None) -> dict[str, list[str]]:
    """The groups of simulator ``env`` (a summary's header; none when it names none)."""
    from slurmvla.registry import SIMULATORS

    return SIMULATORS.get(env).group_table() if env in SIMULATORS else {}


def _line(summary: dict) -> str:
    return (f"success rate {summary['rollout/success_rate']:.3f} ({summary['rollout/successes']}/"
            f"{summary['rollout/episodes']}; 95% CI {summary['rollout/success_ci95_low']:.3f}-"
            f"{summary['rollout/success_ci95_high']:.3f}), mean return {summary['rollout/mean_return']:.2f}, mean length "
            f"{summary['rollout/mean_length']:.1f} steps, {summary['rollout/wall_s']:.1f} s "
            f"({summary['rollout/steps_per_s']:.1f} steps/s, {summary['rollout/requests_per_s']:.1f} requests/s): "
            f"{summary['out']}{_groups_line(summary.get('groups'))}{_failures_line(summary.get('failures'))}")


def _groups_line(groups: dict | None) -> str:
    if not groups:
        return ""
    parts = [f"{name} {g['success_rate']:.3f} ({g['successes']}/{g['episodes']})" for name, g in groups.items()]
    mean = sum(g["success_rate"] for g in groups.values()) / len(groups)
    return f"\nby group: {', '.join(parts)}; mean of the groups {mean:.3f}"


def _failures_line(failures: dict | None) -> str:
    """``rollout.json``'s ``failures`` (an environment with diagnostics: Meta-World) as a second line."""
    if not failures:
        return ""
    parts = [f"{key.replace('_', ' ')} {value}" if isinstance(value, int) else
             f"{key.removesuffix('_m').replace('_', ' ')} {value:.3f}{' m' if key.endswith('_m') else ''} (median)"
             for key, value in failures.items() if key != "episodes"]
    return f"\nof the {failures['episodes']} failed episodes: " + ", ".join(parts)


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog=program("slurmvla.rollout"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", nargs="?", help="a run directory, checkpoint folder or exported file, or ws://HOST:PORT")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. rollout.episodes=50 rollout.replan_steps=8")
    parser.add_argument("--shard", help="I/N: run every N-th episode from the I-th, into rollout_shardIofN.json "
                                         "(default: all, into rollout.json)")
    parser.add_argument("--api-key-env", default="SLURMVLA_API_KEY",
                        help="environment variable holding the server's API key, if it has one (default SLURMVLA_API_KEY)")
    parser.add_argument("--merge", nargs="+", metavar="SHARD_JSON", help="merge shard summaries into --out and exit")
    parser.add_argument("--out", help="the folder the summary and videos go to (rollout.out; default "
                                      "RUN_DIR/rollout/step_N/, ./rollout/ for a server address); with --merge: the "
                                      "merged summary's path")
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # PyOpenGL says at import that its optional accelerator is absent; websockets logs every connection.
    for noisy in ("OpenGL", "websockets"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    import os

    with boundary():
        if args.merge:
            summary = merge([Path(p) for p in args.merge], Path(args.out or "rollout.json"))
        else:
            if not args.source:
                raise ValueError("give a SOURCE (run directory, checkpoint, exported file) or ws://HOST:PORT")
            shard = _parse_shard(args.shard) if args.shard else None
            summary = run(args.source, list(args.overrides), shard, os.environ.get(args.api_key_env), args.out)
    print(_line(summary), flush=True)


if __name__ == "__main__":
    main()
