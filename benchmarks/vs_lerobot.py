"""slurmvla against LeRobot 0.6.1, side by side, each in its own process, ratios from one run.

    bash tests/reference/make_env.sh                 # once: LeRobot 0.6.1 in ../lerobot061
    python benchmarks/vs_lerobot.py [--lerobot-python ../lerobot061/bin/python] [--workers 1 2]
                                    [--episodes 8 --length 250 --batch-size 8 --batches 40]
    python benchmarks/vs_lerobot.py --device cuda [--lerobot-python ...]   # the model part, one GPU, published size

Loading: one LeRobot v3.0 dataset in DROID's encoding (AV1 at GOP 2, CRF 30, 3 cameras at 180x320,
``--length``-frame episodes, 4 per file), written twice: flat scenes (the sample writer's) and scenes
that decode like camera footage (texture, motion, noise). LeRobot's ``LeRobotDataset`` with
``delta_timestamps`` for a 16-step action chunk in a shuffled torch ``DataLoader``, three ways: as
shipped (float frames), with ``return_uint8=True`` (as LeRobot's trainer builds it) and uint8 plus the
same resize-with-pad to 224 in the workers (equal work); against slurmvla's training loader (the
episode stream, resize-with-pad to 224 in the workers), same workers and batch size. Per reader:
samples/s after the first batch, samples per CPU-second (main process and workers), time to first
batch, and per worker the peak RSS and private memory (USS).

Start-up at DROID's size (95.6k episodes, 27.6M frames of metadata and frame data; video files present
but empty, as opening decodes none): ``LeRobotDataset`` (it converts every data file into a ``datasets``
cache on first open) against slurmvla's data layer up to its first epoch's plan; cold and warm.

Training step and inference: the same pi0.5 architecture at a size this CPU runs (``SIZES``), fp32,
activation checkpointing off and on (``--checkpointing``), the same on both sides. LeRobot's
``PI05Policy`` (its size tables patched as tests/reference/generate_pi0_golden.py patches them) with its
own preprocessor, AdamW and clipping; slurmvla's Trainer step on a batch of its loader. Inference:
``predict_action_chunk`` against ``sample_actions``, batch 1, 10 steps. Each side's FLOPs (torch's
``FlopCounterMode``: matrix products, attention, convolutions) are printed beside its time: on a CPU
both are compute-bound, and the time ratio follows the work ratio. The parameter counts
differ by LeRobot's dead weights: the last backbone layer's query, output projection and MLP and the
final norm (the expert reads only that layer's keys and values; LeRobot computes them for every prefix
token) and two unused language-model heads. slurmvla does not build them, and runs the prompt without
its trailing padding (LeRobot runs all ``tokenizer_max_length`` tokens).

``--device cuda`` (the model part only; the other parts stay on the CPU): the same comparison on one GPU
at pi0.5's published size (SigLIP so400m/14 at 224, Gemma 2B, Gemma 300M expert: slurmvla's
``policy=pi05`` as it stands, LeRobot's ``gemma_2b`` / ``gemma_300m`` tables unpatched), 3 cameras,
prompt up to 200 tokens, horizon 50, 10 denoising steps; step at batch 16, inference at batch 1;
activation checkpointing on (``--checkpointing`` to change). Each side in bf16 as its own trainer runs it:

- slurmvla: ``precision=bf16``: live weights bf16 with fp32 master weights and fp32 AdamW state
  (``engine.precision.MasterWeights``), forward under bf16 autocast, clipping on the fp32 master
  gradients, fused AdamW (``optim.fused=auto`` on CUDA). Built on the meta device and initialised on the GPU.
- LeRobot: ``PI05Config(dtype="bfloat16")`` as ``lerobot-train --policy.dtype=bfloat16`` runs it: its
  weights cast to bf16 except the vision tower, projector and norms (fp32), AdamW (torch's default
  foreach kernel) on those weights (bf16 state for the bf16 ones, no fp32 master), and its trainer's
  ``Accelerator(mixed_precision="bf16")``: ``prepare``, forward under ``accelerator.autocast()``,
  ``accelerator.backward``, ``accelerator.clip_grad_norm_``. Built with the GPU as torch's default
  device (``with torch.device("cuda")``: its own classes and initialisation, no fp32 copy on the host).

Inference under bf16 autocast on both sides (LeRobot's trainer evaluates under ``accelerator.autocast()``).
Times with ``torch.cuda.synchronize()`` after each call; peak memory is ``torch.cuda.max_memory_allocated``
(and ``max_memory_reserved``) over the timed training steps, the statistics reset after the warm-up
steps (weights, gradients and optimizer state included). FLOPs: ``FlopCounterMode`` over one more real
step and one more inference call on the GPU (about one step's time). Fewer steps by default (5 timed
after 2 warm-up; inference 20 after 3). LeRobot's preprocessor runs inside its step (the raw batch on
the host as its DataLoader yields it; its device step copies it, about 30 MB); slurmvla's batch is on
the GPU already (its trainer prepares and copies it in the loader's stage).
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
    from slurmvla.config.data import DataConfig
    from slurmvla.data.loader import TrainData
    from slurmvla.data.mixture import Mixture
    from slurmvla.policy import sample_spec
    from slurmvla.policy.flow_vla.config import FlowVLAConfig

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


def _peak_rss_mib() -> float:
    """This process's own peak RSS (VmHWM). Not getrusage's ru_maxrss: Linux carries the parent's peak
    into a child started by fork / vfork and exec, so every side would report at least the peak of
    this script's main process (which writes the DROID-size metadata)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def slurmvla_startup(root: str, cache: str) -> dict:
    from slurmvla.config.data import DataConfig
    from slurmvla.data.mixture import Mixture
    from slurmvla.policy import sample_spec
    from slurmvla.policy.flow_vla.config import FlowVLAConfig

    t0 = time.perf_counter()
    cfg = DataConfig(root=root, cache_dir=cache, cameras=[CAMERA], state_keys=["observation.state"],
                     action_keys=["action"], instruction_keys=[])
    mixture = Mixture(cfg, sample_spec(FlowVLAConfig(action_horizon=HORIZON)), seed=0)
    mixture.plan(0)  # the first epoch's order: what a rank needs before its first batch
    return {"seconds": time.perf_counter() - t0, "peak_rss_mib": _peak_rss_mib(), "samples": mixture.samples_per_epoch}


def lerobot_startup(root: str, cache: str) -> dict:
    import os

    os.environ["HF_DATASETS_CACHE"] = cache  # before datasets is imported
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    t0 = time.perf_counter()
    ds = LeRobotDataset("local/droid_size", root=root,
                        delta_timestamps={"action": [i / 15 for i in range(HORIZON)]})
    return {"seconds": time.perf_counter() - t0, "peak_rss_mib": _peak_rss_mib(), "samples": len(ds)}


# pi0.5 at a size this CPU trains: the published architecture (SigLIP, a Gemma backbone and an action
# expert of the same depth attending jointly, 8 query heads and 1 KV head), narrower and shallower; the
# byte-level tokenizer of tests/golden/lerobot061 on both sides (nothing can be downloaded here).
SIZES = {"image": 112, "patch": 16, "vision": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                                               "intermediate_size": 1024},
         "backbone": (512, 4, 2048, 8, 1, 64), "expert": (256, 4, 1024, 8, 1, 64), "vocab": 320, "text": 128,
         "horizon": 50, "batch": 8, "steps": 10}
# --device cuda: the published size (slurmvla's policy=pi05, LeRobot's gemma_2b / gemma_300m tables), bf16.
# Timed training steps by default, inference calls per timed step, warm-up calls.
PUBLISHED = {"image": 224, "text": 200, "horizon": 50, "batch": 16, "steps": 5}
WARMUP = {"cpu": (2, 2), "cuda": (2, 3)}  # (training steps, inference calls)
INFER_PER_STEP = {"cpu": 3, "cuda": 4}
TOKENIZER = HERE.parents[1] / "tests" / "golden" / "lerobot061" / "tokenizer"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn, steps: int, warmup: int, device: str = "cpu") -> list[float]:
    """Seconds per call after ``warmup`` calls. On CUDA each call is synchronised, and the peak-memory
    statistics are reset after the warm-up (the peak then covers the timed calls)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def _flops(fn) -> float:
    """GFLOP of one call, as torch's FlopCounterMode counts them (matrix products, attention,
    convolutions: the work that sets the time of a compute-bound step); NaN (with the reason on stderr)
    where the counter fails, so the times still come back."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        with FlopCounterMode(display=False) as counter:
            fn()
    except Exception as e:  # noqa: BLE001 - a count is a nicety beside the times
        print(f"FLOP count failed: {type(e).__name__}: {e}", file=sys.stderr)
        return float("nan")
    return counter.get_total_flops() / 1e9


def _gpu_memory() -> dict:
    """Peak allocated and reserved GPU memory since the last reset (MiB), and the GPU."""
    mib = 2**20
    return {"peak_alloc_mib": torch.cuda.max_memory_allocated() / mib,
            "peak_reserved_mib": torch.cuda.max_memory_reserved() / mib,
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}


def _summary(step_s: list[float], infer_s: list[float], params: int, step_gflop: float, infer_gflop: float,
             gpu: dict | None = None) -> dict:
    import statistics

    return {"step_gflop": step_gflop, "infer_gflop": infer_gflop,
            "threads": torch.get_num_threads(), "step_ms": 1e3 * statistics.median(step_s),
            "infer_ms": 1e3 * statistics.median(infer_s),
            "infer_p90_ms": 1e3 * sorted(infer_s)[int(0.9 * (len(infer_s) - 1))], "params": params,
            "peak_rss_mib": _peak_rss_mib(), **(gpu or {})}


def slurmvla_model(steps: int, checkpointing: bool, device: str = "cpu", precision: str = "fp32",
                   published: bool = False) -> dict:
    """slurmvla's Trainer step on a batch of its loader; ``sample_actions`` at batch 1 (under the
    engine's autocast: none in fp32). ``published``: ``policy=pi05`` at its own (published) sizes."""
    from slurmvla.compose import compose
    from slurmvla.data.synthetic import write_droid_sample
    from slurmvla.trainer import Trainer

    if published:
        sizes = ["policy=pi05", f"policy.image_size={PUBLISHED['image']}", f"policy.max_text_len={PUBLISHED['text']}",
                 f"policy.action_horizon={PUBLISHED['horizon']}", "policy.num_cameras=3",
                 f"trainer.global_batch_size={PUBLISHED['batch']}"]
    else:
        (vw, vd, vh, vm), (w, d, m, h, kv, hd), (ew, _, em, *_) = (
            SIZES["vision"].values(), SIZES["backbone"], SIZES["expert"])
        sizes = ["policy=pi05", f"policy.image_size={SIZES['image']}",
                 f"policy.patch_size={SIZES['patch']}", f"policy.vision_width={vw}", f"policy.vision_depth={vd}",
                 f"policy.vision_heads={vh}", f"policy.vision_mlp_dim={vm}", f"policy.width={w}",
                 f"policy.depth={d}", f"policy.mlp_dim={m}", f"policy.num_heads={h}", f"policy.num_kv_heads={kv}",
                 f"policy.head_dim={hd}", f"policy.expert_width={ew}", f"policy.expert_mlp_dim={em}",
                 f"policy.vocab_size={SIZES['vocab']}", f"policy.max_text_len={SIZES['text']}",
                 f"policy.action_horizon={SIZES['horizon']}", f"trainer.global_batch_size={SIZES['batch']}"]
    warm_step, warm_infer = WARMUP[device]
    with tempfile.TemporaryDirectory() as tmp:
        root = write_droid_sample(Path(tmp) / "data", 4, seed=0, episodes_per_file=4, length=60)
        cfg = compose([f"data.root={root}", "data.num_workers=0", "logging.wandb.mode=disabled", "trainer.progress_bar=false",
                       "checkpoint.every_steps=0", *sizes, "policy.num_inference_steps=10", f"trainer.device={device}",
                       f"precision={precision}", f"policy.gradient_checkpointing={str(checkpointing).lower()}"])
        t0 = time.perf_counter()
        trainer = Trainer(cfg, Path(tmp) / "run")
        _sync(device)
        build_s = time.perf_counter() - t0
        batch = trainer._next_batch()
        step_s = _timed(lambda: trainer.train_step([batch]), steps, warm_step, device)
        gpu = _gpu_memory() if device == "cuda" else None
        step_gflop = _flops(lambda: trainer.train_step([batch]))
        policy = trainer.policy.eval()
        one = {k: v[:1] for k, v in batch.items()}

        def infer():
            with trainer.engine.autocast():
                return policy.sample_actions(one)

        with torch.inference_mode():
            infer_s = _timed(infer, INFER_PER_STEP[device] * steps, warm_infer, device)
            infer_gflop = _flops(infer)
        params = sum(p.numel() for p in policy.parameters())
        trainer.close()
    return {**_summary(step_s, infer_s, params, step_gflop, infer_gflop, gpu), "build_s": build_s, "built_on": device}


def lerobot_model(steps: int, checkpointing: bool, device: str = "cpu", precision: str = "fp32",
                  published: bool = False) -> dict:
    """LeRobot's PI05Policy with its own preprocessor, AdamW and clipping, as its trainer steps it;
    ``predict_action_chunk`` at batch 1. ``published``: its size tables as shipped (gemma_2b, gemma_300m,
    SigLIP so400m/14), else patched to ``SIZES``. ``precision="bf16"``: ``dtype="bfloat16"`` and
    Accelerate's bf16 autocast, as ``lerobot-train --policy.dtype=bfloat16`` runs it."""
    import contextlib

    sys.path.insert(0, str(HERE.parents[1] / "tests" / "reference"))
    import generate_pi0_golden as golden  # LeRobot's size tables, patched as the golden files patch them
    import transformers
    from lerobot.configs import FeatureType, PolicyFeature
    from lerobot.policies.pi05 import modeling_pi05 as modeling
    from lerobot.policies.pi05.configuration_pi05 import PI05Config
    from lerobot.policies.pi05.processor_pi05 import make_pi05_pre_post_processors

    sizes = PUBLISHED if published else SIZES
    if not published:
        golden.TINY_GEMMA.update({"bench_backbone": SIZES["backbone"], "bench_expert": SIZES["expert"]})
        golden.TINY_SIGLIP.update({**SIZES["vision"], "patch_size": SIZES["patch"]})
        golden.patch_sizes(modeling)
    res, horizon, b = sizes["image"], sizes["horizon"], sizes["batch"]
    cams = ("observation.images.exterior_1_left", "observation.images.exterior_2_left", "observation.images.wrist_left")
    config = PI05Config(
        paligemma_variant="gemma_2b", action_expert_variant="gemma_300m", chunk_size=horizon, n_action_steps=horizon,
        image_resolution=(res, res), tokenizer_max_length=sizes["text"], num_inference_steps=10, device=device,
        gradient_checkpointing=checkpointing, dtype="bfloat16" if precision == "bf16" else "float32",
        input_features={**{c: PolicyFeature(type=FeatureType.VISUAL, shape=(3, res, res)) for c in cams},
                        "observation.state": PolicyFeature(type=FeatureType.STATE, shape=(8,))},
        output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(8,))})
    if not published:
        config.paligemma_variant, config.action_expert_variant = "bench_backbone", "bench_expert"
    t0 = time.perf_counter()
    torch.manual_seed(0)
    built_on = device
    try:  # on a GPU, with it as torch's default device: LeRobot's own classes and initialisation, run there
        with torch.device(device) if device != "cpu" else contextlib.nullcontext():
            policy = modeling.PI05Policy(config)
    except Exception as e:  # noqa: BLE001 - then as LeRobot builds it: on the host, then moved
        if device == "cpu":
            raise
        print(f"building on {device} failed ({type(e).__name__}: {e}); building on the host", file=sys.stderr)
        import gc

        gc.collect()
        torch.cuda.empty_cache()
        torch.manual_seed(0)
        built_on, policy = "cpu", modeling.PI05Policy(config)
    _sync(device)
    build_s = time.perf_counter() - t0
    stats = {k: {s: torch.full((8,), v) for s, v in (("mean", 0.0), ("std", 1.0), ("q01", -1.0), ("q99", 1.0),
                                                      ("min", -2.0), ("max", 2.0))} for k in ("observation.state", "action")}
    real = transformers.AutoTokenizer.from_pretrained
    transformers.AutoTokenizer.from_pretrained = lambda name, *a, **kw: real(str(TOKENIZER), *a, **kw)
    try:
        pre, _ = make_pi05_pre_post_processors(config, dataset_stats=stats)
    finally:
        transformers.AutoTokenizer.from_pretrained = real
    g = torch.Generator().manual_seed(0)

    def raw(n: int) -> dict:
        return {**{c: torch.rand(n, 3, res, res, generator=g) for c in cams},
                "observation.state": torch.rand(n, 8, generator=g) * 2 - 1,
                "action": torch.rand(n, horizon, 8, generator=g) * 2 - 1,
                "task": ["put the yellow sponge in the left bin"] * n}

    batch = raw(b)
    opt = torch.optim.AdamW(policy.parameters(), lr=2.5e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    if precision == "bf16":
        # lerobot-train: Accelerator(mixed_precision from policy.dtype), prepare, and update_policy's calls.
        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs

        accelerator = Accelerator(step_scheduler_with_optimizer=False, mixed_precision="bf16", cpu=device == "cpu",
                                  kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
        policy, opt = accelerator.prepare(policy, opt)
        autocast, backward = accelerator.autocast, accelerator.backward
        clip = accelerator.clip_grad_norm_
    else:
        autocast, backward = contextlib.nullcontext, lambda loss: loss.backward()
        clip = torch.nn.utils.clip_grad_norm_

    def step() -> None:  # what LeRobot's trainer does per step: its preprocessor, forward, backward, clip, AdamW
        with autocast():
            loss, _ = policy.forward(pre(dict(batch)))
        backward(loss)
        clip(policy.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    warm_step, warm_infer = WARMUP[device]
    policy.train()
    step_s = _timed(step, steps, warm_step, device)
    gpu = _gpu_memory() if device == "cuda" else None
    step_gflop = _flops(step)
    policy.eval()
    one = raw(1)
    one.pop("action")

    def infer():
        with autocast():
            return policy.predict_action_chunk(pre(dict(one)))

    with torch.inference_mode():
        infer_s = _timed(infer, INFER_PER_STEP[device] * steps, warm_infer, device)
        infer_gflop = _flops(infer)
    return {**_summary(step_s, infer_s, sum(p.numel() for p in policy.parameters()), step_gflop, infer_gflop, gpu),
            "build_s": build_s, "built_on": built_on}


def side(argv: list[str]) -> None:
    kind, *rest = argv
    if not kind.endswith("-model"):  # data loading: one thread per process, as DataLoader workers run
        torch.set_num_threads(1)
    if kind.endswith("-model"):
        device = rest[2] if len(rest) > 2 else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise SystemExit(f"error: --device cuda, but this Python's torch {torch.__version__} sees no CUDA device")
        fn = slurmvla_model if kind == "slurmvla-model" else lerobot_model
        result = fn(int(rest[0]), rest[1] == "on", device, "bf16" if device == "cuda" else "fp32", device == "cuda")
    elif kind.endswith("-startup"):
        result = (slurmvla_startup if kind == "slurmvla-startup" else lerobot_startup)(*rest)
    else:
        root, workers, batch_size, batches, *mode = rest
        args = (root, int(workers), int(batch_size), int(batches))
        result = slurmvla_loading(*args) if kind == "slurmvla-loading" else lerobot_loading(*args, *mode)
    print("RESULT " + json.dumps(result))


# -- the orchestrator (slurmvla's Python) ----------------------------------------------------------

def run_side(python: str, *args: object, timeout: float | None = None) -> dict:
    try:
        res = subprocess.run([python, str(HERE), "--side", *(str(a) for a in args)], capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise SystemExit(f"error: {' '.join(str(a) for a in args[:1])} ran past {timeout:.0f} s:\n{err[-3000:]}") from None
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    if res.returncode != 0 or not lines:
        raise SystemExit(f"error: {' '.join(str(a) for a in args[:1])} failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def lerobot_versions(python: str) -> str:
    code = ("import importlib.metadata as m\n"
            "def v(k):\n    try:\n        return m.version(k)\n    except m.PackageNotFoundError:\n        return None\n"
            "print({k: v(k) for k in ('lerobot', 'torch', 'transformers', 'datasets', 'torchcodec')})")
    res = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"error: {python} failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
    return res.stdout.strip()


def loading(args, tmp: Path) -> None:
    from slurmvla.data.synthetic import write_droid_sample

    print(f"loading: {args.episodes} episodes x {args.length} frames, 3 cameras 180x320 AV1 GOP 2, 4 episodes per file; "
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


CAMERA = "observation.images.exterior_1_left"


def write_droid_size(root: Path, episodes: int, frames: int, per_file: int = 1000) -> None:
    """Metadata and frame data at DROID's size in LeRobot's v3.0 layout as LeRobot's writer lays it out
    (one camera; its video files exist but are empty: opening a dataset decodes none)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sys.path.insert(0, str(HERE.parent))
    from data_index import synthetic_droid

    from slurmvla.data.writer import write_tasks

    lengths = synthetic_droid(episodes, frames)[0]
    n = len(lengths)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    file_of = np.arange(n) // per_file
    local = starts - starts[file_of * per_file]
    vec = {"dtype": "float32", "shape": [8], "names": None}
    one = lambda dtype: {"dtype": dtype, "shape": [1], "names": None}  # noqa: E731
    features = {CAMERA: {"dtype": "video", "shape": [180, 320, 3], "names": ["height", "width", "channels"],
                         "info": {"video.fps": 15, "video.height": 180, "video.width": 320, "video.channels": 3,
                                  "video.codec": "av1", "video.pix_fmt": "yuv420p", "video.is_depth_map": False,
                                  "has_audio": False}},
                "observation.state": vec, "action": vec, "timestamp": one("float32"), "frame_index": one("int64"),
                "episode_index": one("int64"), "index": one("int64"), "task_index": one("int64")}
    (root / "meta" / "episodes" / "chunk-000").mkdir(parents=True)
    episodes_table = pa.table({
        "episode_index": np.arange(n), "tasks": [["do it"]] * n, "length": lengths,
        "data/chunk_index": file_of // 1000, "data/file_index": file_of % 1000,
        "dataset_from_index": starts, "dataset_to_index": ends,
        f"videos/{CAMERA}/chunk_index": file_of // 1000, f"videos/{CAMERA}/file_index": file_of % 1000,
        f"videos/{CAMERA}/from_timestamp": local / 15.0, f"videos/{CAMERA}/to_timestamp": (local + lengths) / 15.0,
        "meta/episodes/chunk_index": np.zeros(n, np.int64), "meta/episodes/file_index": np.zeros(n, np.int64)})
    pq.write_table(episodes_table, root / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    for f in range(int(file_of.max()) + 1):
        eps = np.arange(f * per_file, min(n, (f + 1) * per_file))
        lo, hi = int(starts[eps[0]]), int(ends[eps[-1]])
        m = hi - lo
        frame = np.concatenate([np.arange(k) for k in lengths[eps]])
        zeros = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(8 * m, np.float32)), 8)
        path = root / f"data/chunk-{f // 1000:03d}/file-{f % 1000:03d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"observation.state": zeros, "action": zeros,
                                 "timestamp": pa.array((frame / 15).astype(np.float32)), "frame_index": frame,
                                 "episode_index": np.repeat(eps, lengths[eps]), "index": np.arange(lo, hi),
                                 "task_index": np.zeros(m, np.int64)}), path)
        video = root / f"videos/{CAMERA}/chunk-{f // 1000:03d}/file-{f % 1000:03d}.mp4"
        video.parent.mkdir(parents=True, exist_ok=True)
        video.touch()
    stat = {"mean": [0.0] * 8, "std": [1.0] * 8, "min": [-1.0] * 8, "max": [1.0] * 8, "count": [int(ends[-1])]}
    (root / "meta" / "stats.json").write_text(json.dumps({"observation.state": stat, "action": stat}))
    write_tasks(root / "meta" / "tasks.parquet", ["do it"])  # as LeRobot writes it (slurmvla's writer)
    info = {"codebase_version": "v3.0", "robot_type": "franka", "fps": 15, "total_episodes": n,
            "total_frames": int(ends[-1]), "total_tasks": 1, "chunks_size": 1000, "data_files_size_in_mb": 100,
            "video_files_size_in_mb": 500, "splits": {"train": f"0:{n}"},
            "data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
            "video_path": "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4", "features": features}
    (root / "meta" / "info.json").write_text(json.dumps(info, indent=1))


def startup(args, tmp: Path) -> None:
    root = tmp / "droid_size"
    t0 = time.perf_counter()
    write_droid_size(root, args.startup_episodes, args.startup_frames)
    print(f"start-up: {args.startup_episodes} episodes, {args.startup_frames} frames (wrote them in "
          f"{time.perf_counter() - t0:.0f} s); the first open (cold: LeRobot converts the data files into its "
          "datasets cache) and a second (warm)")
    print(f"{'':9s} {'side':9s} {'seconds':>8s} {'peak RSS MiB':>13s} {'samples':>10s}")
    rows = {}
    for state in ("cold", "warm"):
        for name, python in (("slurmvla", sys.executable), ("LeRobot", args.lerobot_python)):
            kind = "slurmvla-startup" if name == "slurmvla" else "lerobot-startup"
            r = rows[state, name] = run_side(python, kind, root, tmp / f"cache-{name}")
            print(f"{state:9s} {name:9s} {r['seconds']:8.2f} {r['peak_rss_mib']:13.0f} {r['samples']:10d}")
    for state in ("cold", "warm"):
        a, b = rows[state, "slurmvla"], rows[state, "LeRobot"]
        print(f"{state}: LeRobot / slurmvla time {b['seconds'] / a['seconds']:.1f}x, peak memory "
              f"{b['peak_rss_mib'] / a['peak_rss_mib']:.1f}x")


def model(args, tmp: Path) -> None:
    cuda = args.device == "cuda"
    sizes = PUBLISHED if cuda else SIZES
    if cuda:
        print(f"training step and inference, pi0.5 at the published size on one GPU, bf16 on both sides (slurmvla: "
              f"bf16 weights, fp32 masters and AdamW state, autocast, fused AdamW; LeRobot: dtype=bfloat16, vision "
              f"tower fp32, AdamW on its weights, Accelerate's bf16 autocast): slurmvla policy=pi05, LeRobot "
              f"gemma_2b + gemma_300m; image {sizes['image']} (3 cameras), text {sizes['text']}, horizon "
              f"{sizes['horizon']}; step: batch {sizes['batch']}, AdamW, clipping (LeRobot: its preprocessor too), "
              f"{args.steps} timed after {WARMUP['cuda'][0]}; inference: batch 1, 10 steps, "
              f"{INFER_PER_STEP['cuda'] * args.steps} timed after {WARMUP['cuda'][1]}; activation checkpointing "
              f"{' and '.join(args.checkpointing)}, the same on both sides", flush=True)
        mem_head = f"{'peak alloc MiB':>14s} {'reserved MiB':>12s}"
    else:
        print(f"training step and inference, pi0.5 on the CPU, fp32: image {SIZES['image']} (3 cameras), backbone "
              f"{SIZES['backbone']}, expert {SIZES['expert']} (width, depth, mlp, heads, kv heads, head dim), SigLIP "
              f"{tuple(SIZES['vision'].values())}, text {SIZES['text']}, horizon {SIZES['horizon']}; step: batch "
              f"{SIZES['batch']}, AdamW, clipping (LeRobot: its preprocessor too); inference: batch 1, 10 steps; "
              "activation checkpointing off and on, the same on both sides")
        mem_head = f"{'peak RSS MiB':>12s}"
    flop, per = ("TFLOP", 1e3) if cuda else ("GFLOP", 1.0)  # the published size's step: hundreds of TFLOP
    head = (f"{'ckpt':4s} {'side':9s} {'threads':>7s} {'params':>10s} {'step ms':>9s} {'samples/s':>9s} {flop:>7s} "
            f"{'infer ms p50':>12s} {'p90':>7s} {flop:>7s} {mem_head}")
    if not cuda:
        print(head)
    ratios, failed, builds, shown = [], [], [], False
    mem = "peak_alloc_mib" if cuda else "peak_rss_mib"
    for ckpt in args.checkpointing:
        rows = {}
        for name, python, kind in (("slurmvla", sys.executable, "slurmvla-model"),
                                   ("LeRobot", args.lerobot_python, "lerobot-model")):
            side_args = (kind, args.steps, ckpt, *((args.device,) if cuda else ()))
            try:
                r = rows[name] = run_side(python, *side_args, timeout=args.side_timeout)
            except SystemExit as e:  # the other side's figures still come back
                failed.append(f"{name} (ckpt {ckpt})")
                print(f"{ckpt:4s} {name:9s} {e}", file=sys.stderr, flush=True)
                continue
            if cuda and not shown:
                print(f"device: {r['gpu']}, torch {r['torch']}\n{head}")
                shown = True
            line = (f"{ckpt:4s} {name:9s} {r['threads']:7d} {r['params']:10d} {r['step_ms']:9.0f} "
                    f"{sizes['batch'] / r['step_ms'] * 1e3:9.2f} {r['step_gflop'] / per:7.1f} {r['infer_ms']:12.0f} "
                    f"{r['infer_p90_ms']:7.0f} {r['infer_gflop'] / per:7.1f} ")
            line += f"{r['peak_alloc_mib']:14.0f} {r['peak_reserved_mib']:12.0f}" if cuda else f"{r['peak_rss_mib']:12.0f}"
            print(line, flush=True)
            builds.append(f"{name} {r['build_s']:.1f} on {r['built_on']} (ckpt {ckpt})")
        if len(rows) < 2:
            continue
        a, b = rows["slurmvla"], rows["LeRobot"]
        ratios.append(f"checkpointing {ckpt}: step time {a['step_ms'] / b['step_ms']:.2f}x (FLOPs "
                      f"{a['step_gflop'] / b['step_gflop']:.2f}x), inference {a['infer_ms'] / b['infer_ms']:.2f}x (FLOPs "
                      f"{a['infer_gflop'] / b['infer_gflop']:.2f}x), peak memory {a[mem] / b[mem]:.2f}x")
    if ratios:
        print("slurmvla / LeRobot:\n  " + "\n  ".join(ratios))
    if cuda and builds:
        print("built in (s): " + ", ".join(builds) + " (slurmvla: its Trainer, data included)")
    if failed:
        raise SystemExit(f"error: failed: {', '.join(failed)}")


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
    parser.add_argument("--startup-episodes", type=int, default=95_600, help="start-up: episodes (DROID: 95.6k)")
    parser.add_argument("--startup-frames", type=int, default=27_600_000, help="start-up: frames (DROID: 27.6M)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"model: timed training steps (default {SIZES['steps']} on the CPU, {PUBLISHED['steps']} on "
                             f"CUDA; inference calls {INFER_PER_STEP['cpu']}x / {INFER_PER_STEP['cuda']}x that)")
    parser.add_argument("--checkpointing", nargs="+", choices=("off", "on"), default=None,
                        help="model: activation checkpointing, the same on both sides (default: off and on on the "
                             "CPU, on on CUDA)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="model: cpu (fp32, the small SIZES) or cuda (one GPU, the published size, bf16)")
    parser.add_argument("--side-timeout", type=float, default=None,
                        help="model: seconds each side may run (default: none on the CPU, 300 on CUDA)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=None,
                        help="default: all on the CPU; model with --device cuda")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    args.parts = args.parts or (["model"] if cuda else list(PARTS))
    args.steps = args.steps or (PUBLISHED["steps"] if cuda else SIZES["steps"])
    args.checkpointing = args.checkpointing or (["on"] if cuda else ["off", "on"])
    if args.side_timeout is None and cuda:
        args.side_timeout = 300.0
    if cuda and not torch.cuda.is_available():
        raise SystemExit(f"error: --device cuda, but torch {torch.__version__} sees no CUDA device here")
    if not Path(args.lerobot_python).is_file():
        raise SystemExit(f"error: --lerobot-python={args.lerobot_python!r} does not exist; build it with "
                         "bash tests/reference/make_env.sh")
    print(f"LeRobot side: {lerobot_versions(args.lerobot_python)}; slurmvla side: torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        for part in args.parts:
            PARTS[part](args, Path(tmp))


PARTS = {"loading": loading, "startup": startup, "model": model}

if __name__ == "__main__":
    main()
