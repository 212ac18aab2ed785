"""slurmvla against LeRobot 0.6.1, side by side, each in its own process, ratios from one run.

    bash tests/reference/make_env.sh                 # once: LeRobot 0.6.1 in ../lerobot061
    python benchmarks/vs_lerobot.py [--lerobot-python ../lerobot061/bin/python] [--workers 1 2]
                                    [--episodes 8 --length 250 --batch-size 8 --batches 40]

Loading: one LeRobot v3.0 dataset in DROID's encoding (AV1 at GOP 2, CRF 30, 3 cameras at 180x320,
``--length``-frame episodes, 4 per file), written twice: flat scenes (the sample writer's) and scenes
that decode like camera footage (texture, motion, noise). LeRobot's ``LeRobotDataset`` with
``delta_timestamps`` for a 16-step action chunk in a shuffled torch ``DataLoader``, three ways: as
shipped (float frames), with ``return_uint8=True`` (as LeRobot's trainer builds it) and uint8 plus the
same resize-with-pad to 224 in the workers (equal work); against slurmvla's training loader (the
episode stream, resize-with-pad to 224 in the workers), same workers and batch size. Per reader:
samples/s after the first batch, samples per CPU-second (main process and workers), time to first
batch, and per worker the peak RSS and private memory (USS).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import torch

HERE = Path(__file__).resolve()
HORIZON, IMAGE_SIZE = 16, 224
LEROBOT_MODES = ("shipped", "uint8", "uint8+pad224")


class Watch:
    """Peak RSS and USS of each DataLoader worker (children of this process), sampled in a thread;
    CPU seconds of this process and its workers between :meth:`mark` and :meth:`stop`."""

    def __init__(self, every_s: float = 0.25):
        self.every_s, self.rss, self.uss = every_s, {}, {}
        self.cpu_at_mark: dict[int, float] = {}
        self.cpu_last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _procs(self) -> list[psutil.Process]:
        me = psutil.Process()
        return [me, *me.children(recursive=True)]

    def _run(self) -> None:
        me = psutil.Process().pid
        while not self._stop.is_set():
            for p in self._procs():
                try:
                    t = p.cpu_times()
                    self.cpu_last[p.pid] = t.user + t.system
                    if p.pid != me:
                        mem = p.memory_full_info()
                        self.rss[p.pid] = max(self.rss.get(p.pid, 0), mem.rss)
                        self.uss[p.pid] = max(self.uss.get(p.pid, 0), mem.uss)
                except psutil.Error:
                    pass
            time.sleep(self.every_s)

    def mark(self) -> None:
        for p in self._procs():
            try:
                t = p.cpu_times()
                self.cpu_at_mark[p.pid] = self.cpu_last[p.pid] = t.user + t.system
            except psutil.Error:
                pass

    def stop(self) -> float:
        """CPU seconds since :meth:`mark` (workers read while they are alive: call before the loader ends)."""
        for p in self._procs():
            try:
                t = p.cpu_times()
                self.cpu_last[p.pid] = t.user + t.system
            except psutil.Error:
                pass
        self._stop.set()
        self._thread.join()
        return sum(v - self.cpu_at_mark.get(pid, 0.0) for pid, v in self.cpu_last.items())


def measure(make_loader, batches: int) -> dict:
    """Time to first batch (workers start, first samples), then ``batches`` batches."""
    watch = Watch()
    t0 = time.perf_counter()
    loader = make_loader()
    it = iter(loader)
    first = next(it)
    first_s = time.perf_counter() - t0
    watch.mark()
    t1 = time.perf_counter()
    n = 0
    for _ in range(batches):
        batch = next(it)
        n += len(batch["action"] if "action" in batch else batch["actions"])
    seconds = time.perf_counter() - t1
    cpu = watch.stop()
    del first, it, loader
    mib = 2**20
    return {"samples": n, "samples_per_s": n / seconds, "samples_per_cpu_s": n / max(cpu, 1e-9), "first_batch_s": first_s,
            "worker_rss_mib": max(watch.rss.values(), default=0) / mib,
            "worker_uss_mib": max(watch.uss.values(), default=0) / mib}


# -- the two sides (each runs in its own process) ---------------------------------------------------

def slurmvla_loading(root: str, workers: int, batch_size: int, batches: int) -> dict:
    from slurmvla.config import DataConfig, FlowVLAConfig
    from slurmvla.data.loader import TrainData
    from slurmvla.data.mixture import Mixture
    from slurmvla.policy import sample_spec

    cfg = DataConfig(root=root, num_workers=workers, image_resize="pad")
    spec = sample_spec(FlowVLAConfig(image_size=IMAGE_SIZE, patch_size=16, action_horizon=HORIZON, max_text_len=48))

    def make():
        data = TrainData(Mixture(cfg, spec, seed=0), cfg, batch_size, rank=0, world_size=1, seed=0)
        return data.iterate(0, 0)

    return measure(make, batches)


def _pad_to(size: int):
    """Resize keeping the aspect ratio, then pad with black to ``size`` x ``size`` (uint8 [C, H, W])."""
    import torch.nn.functional as F

    def transform(img: torch.Tensor) -> torch.Tensor:
        h, w = img.shape[-2:]
        scale = size / max(h, w)
        nh, nw = round(h * scale), round(w * scale)
        x = F.interpolate(img[None].float(), size=(nh, nw), mode="bilinear", align_corners=False, antialias=True)[0]
        out = torch.zeros((img.shape[0], size, size), dtype=img.dtype)
        top, left = (size - nh) // 2, (size - nw) // 2
        out[:, top : top + nh, left : left + nw] = x.round().clamp(0, 255).to(img.dtype) if img.dtype == torch.uint8 else x
        return out

    return transform


def lerobot_loading(root: str, workers: int, batch_size: int, batches: int, mode: str) -> dict:
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    fps = json.loads((Path(root) / "meta" / "info.json").read_text())["fps"]
    kwargs = {"return_uint8": mode != "shipped"}
    if mode == "uint8+pad224":
        kwargs["image_transforms"] = _pad_to(IMAGE_SIZE)

    def make():
        ds = LeRobotDataset("local/bench", root=root, delta_timestamps={"action": [i / fps for i in range(HORIZON)]},
                            **kwargs)
        return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=workers,
                                           generator=torch.Generator().manual_seed(0),
                                           prefetch_factor=2 if workers else None)

    return measure(make, batches)


def side(argv: list[str]) -> None:
    torch.set_num_threads(1)
    kind, root, workers, batch_size, batches, *rest = argv
    args = (root, int(workers), int(batch_size), int(batches))
    result = slurmvla_loading(*args) if kind == "slurmvla-loading" else lerobot_loading(*args, *rest)
    print("RESULT " + json.dumps(result))


# -- the orchestrator (slurmvla's Python) ----------------------------------------------------------

def run_side(python: str, *args: object) -> dict:
    res = subprocess.run([python, str(HERE), "--side", *(str(a) for a in args)], capture_output=True, text=True)
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    if res.returncode != 0 or not lines:
        raise SystemExit(f"error: {' '.join(str(a) for a in args[:1])} failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def lerobot_versions(python: str) -> str:
    code = "import importlib.metadata as m; print({k: m.version(k) for k in ('lerobot', 'torch', 'datasets', 'torchcodec')})"
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def loading(args, tmp: Path) -> None:
    from slurmvla.data.synthetic import write_droid_sample

    print(f"LeRobot side: {lerobot_versions(args.lerobot_python)}; slurmvla side: torch {torch.__version__}")
    print(f"data: {args.episodes} episodes x {args.length} frames, 3 cameras 180x320 AV1 GOP 2, 4 episodes per file; "
          f"batch {args.batch_size}, {args.batches} batches after the first, chunk {HORIZON}, frames to {IMAGE_SIZE} where "
          "resized")
    head = (f"{'content':7s} {'workers':>7s} {'reader':22s} {'samples/s':>9s} {'/CPU-s':>7s} {'first s':>8s} "
            f"{'RSS/wkr':>8s} {'USS/wkr':>8s}   {'vs LeRobot same work: samples/s, USS'}")
    for content in ("flat", "camera"):
        root = write_droid_sample(tmp / content, args.episodes, seed=0, episodes_per_file=4, length=args.length,
                                  content=content)
        print(head)
        for workers in args.workers:
            common = (root, workers, args.batch_size, args.batches)
            rows = {"slurmvla stream": run_side(sys.executable, "slurmvla-loading", *common)}
            for mode in LEROBOT_MODES:
                rows[f"LeRobot {mode}"] = run_side(args.lerobot_python, "lerobot-loading", *common, mode)
            ours, equal = rows["slurmvla stream"], rows["LeRobot uint8+pad224"]
            for name, r in rows.items():
                vs = "" if name != "slurmvla stream" else \
                    f"   {r['samples_per_s'] / equal['samples_per_s']:.2f}x, {r['worker_uss_mib'] / equal['worker_uss_mib']:.2f}x"
                print(f"{content:7s} {workers:7d} {name:22s} {r['samples_per_s']:9.1f} {r['samples_per_cpu_s']:7.1f} "
                      f"{r['first_batch_s']:8.2f} {r['worker_rss_mib']:8.0f} {r['worker_uss_mib']:8.0f}{vs}")
            del ours


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--side":
        side(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lerobot-python", default=str(HERE.parents[2] / "lerobot061" / "bin" / "python"),
                        help="the LeRobot 0.6.1 virtualenv's python (default ../lerobot061, as make_env.sh builds it)")
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--length", type=int, default=250, help="frames per episode")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--batches", type=int, default=40, help="batches timed after the first")
    args = parser.parse_args()
    if not Path(args.lerobot_python).is_file():
        raise SystemExit(f"error: --lerobot-python={args.lerobot_python!r} does not exist; build it with "
                         "bash tests/reference/make_env.sh")
    with tempfile.TemporaryDirectory() as tmp:
        loading(args, Path(tmp))


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
