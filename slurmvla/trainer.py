"""The Trainer: builds the components, runs ``train_step`` until ``max_steps``, checkpoints, resumes.

``fit`` reads as a list of hand-offs: take micro-batches -> engine step (-> moving average) ->
schedule -> log -> checkpoint. Everything strategy-specific sits behind the engine; there is no branch on its name here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from slurmvla import garbage_collector
from slurmvla.checkpoint import CheckpointManager
from slurmvla.collectives import agree, check_same_fields, gather_objects
from slurmvla.config import Config
from slurmvla.data.damaged import DamageCount
from slurmvla.data.loader import TrainData, build_validation_loader, to_device
from slurmvla.data.mixture import Mixture
from slurmvla.data.synthetic import ensure_sample_dataset
from slurmvla.engine import build_engine
from slurmvla.engine.distributed import (
    init_process_group,
    select_device,
    set_determinism,
    shutdown_process_group,
)
from slurmvla.engine.ema import MovingAverage
from slurmvla.engine.liveness import CollectiveFailure, Heartbeats, is_collective_failure
from slurmvla.engine.precision import check_fp32_master_state
from slurmvla.formats import run_dir_version, write_run_format
from slurmvla.launch import DistEnv, SlurmJob
from slurmvla.launch.eval_array import ArraySettings, EvalArrays, check_submission
from slurmvla.launch.grace import shortfalls
from slurmvla.launch.preempt import FINISHED_MARKER, PreemptionFlag
from slurmvla.launch.runlock import RunDirInUse, RunLock
from slurmvla.launch.runtime import apply_process_defaults, write_snapshot
from slurmvla.logger import MetricLogger
from slurmvla.optim import build_scheduler
from slurmvla.planner.recompute_choice import resolve as resolve_recompute
from slurmvla.policy import build_policy, policy_class
from slurmvla.policy.compiled_layers import compile_units
from slurmvla.policy.stats import resolve_stats
from slurmvla.registry import ENGINES
from slurmvla.seeding import GlobalGenerators, seed_everything
from slurmvla.validation import validate

log = logging.getLogger("slurmvla")


class PhaseMarks(Protocol):
    def mark(self, phase: str) -> None: ...


class _NoMarks:
    def mark(self, phase: str) -> None:
        pass


_NO_MARKS = _NoMarks()


class Trainer:
    def __init__(self, cfg: Config, run_dir: str | Path, env: DistEnv | None = None,
                 closed_loop: Callable[..., dict[str, float] | None] | None = None):
        """``closed_loop``: what ``trainer.rollout_every_steps`` calls, as
        ``closed_loop(policy, cfg, step, run_dir, rank, world_size, weights=...)`` on every rank (``weights``:
        ``ema`` when the policy holds the moving average, ``serve.weights``), returning the
        metrics on rank 0 (``python -m slurmvla.train`` passes :func:`slurmvla.inference.closed_loop.in_training`).
        With ``rollout_array.enabled`` the evaluations run off the job instead, as SLURM job arrays
        (slurmvla.launch.eval_array), and need no ``closed_loop``."""
        if cfg.trainer.rollout_every_steps and closed_loop is None and not cfg.rollout_array.enabled:
            raise ValueError(f"trainer.rollout_every_steps={cfg.trainer.rollout_every_steps} needs the closed loop: "
                             "python -m slurmvla.train provides it; a Trainer built in code takes "
                             "closed_loop=slurmvla.inference.closed_loop.in_training")
        self._closed_loop = closed_loop
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.env = env or DistEnv.from_environ()
        self.micro_batch_size = cfg.trainer.micro_batch_size(self.env.world_size)
        # First: a stop signal during start-up (rendezvous, data, weights) is kept, not fatal; the
        # ranks act on it before the first step (slurmvla.launch.preempt).
        self.preempt = PreemptionFlag()
        self.preempt.install()
        self.stopped_for_requeue = False
        self._grace_checked = False
        self._fit_start: tuple[float, int] | None = None  # (time, step) when fit began: the step time
        self.heartbeats = None
        self.run_lock: RunLock | None = None
        self.evaluations: EvalArrays | None = None  # rank 0, with rollout_array.enabled
        try:
            self._join_job()
            self._lock_run_dir()
            # A run directory a newer release wrote is refused before anything is built (every rank reads the
            # file before rank 0 writes its own, after _build_data's barrier).
            run_dir_version(self.run_dir)
            self._build_data()
            self._build_model()
            self._open_run_dir()
            self._open_evaluations()
            self.resumed_from: Path | None = None
            if cfg.checkpoint.resume:
                self._resume()
            if self.evaluations is not None:
                self.evaluations.resumed_at(self.step)
            self.logger.start(self.step)
        except BaseException:
            self._unlock_run_dir()
            self._stop_heartbeats()
            self.preempt.uninstall()
            raise

    def _join_job(self) -> None:
        """Device, process group, and one run directory for every rank."""
        apply_process_defaults(self.env.is_main)
        if self.cfg.trainer.deterministic:
            set_determinism()
        self.device = select_device(self.cfg.trainer.device, self.env)
        if self.env.source in ("slurm", "submitit"):
            # The engine and any child process see torchrun's names; set variables are kept, and said.
            for kept in self.env.export_to():
                log.warning("keeping the environment's %s", kept)
        init_process_group(self.env, self.device, self.cfg.engine.backend, self.cfg.engine.timeout_s,
                           required=ENGINES.get(self.cfg.engine.name).multi_process)
        # Every rank publishes that it is alive and its step: a failed collective can then name the
        # rank that stopped (slurmvla.engine.liveness).
        self.heartbeats = Heartbeats(self.env) if self.env.is_distributed else None
        if self.env.is_distributed:
            # Every rank writes into rank 0's run directory (a timestamped default can differ by a
            # second between ranks).
            shared = [str(self.run_dir)]
            torch.distributed.broadcast_object_list(shared, src=0)
            self.run_dir = Path(shared[0])

    def _lock_run_dir(self) -> None:
        """One run per run directory (slurmvla.launch.runlock): rank 0 takes the lock; every rank
        stops with the same error when another live run holds it."""
        self.run_lock = RunLock(self.run_dir) if self.env.is_main else None
        outcome: list = [None]
        if self.run_lock is not None:
            try:
                note = self.run_lock.acquire()
                if note:
                    log.warning("%s", note)
            except RunDirInUse as e:
                self.run_lock, outcome[0] = None, str(e)
        if self.env.is_distributed:
            torch.distributed.broadcast_object_list(outcome, src=0)
        if outcome[0]:
            raise RunDirInUse(outcome[0])

    def _unlock_run_dir(self) -> None:
        if self.run_lock is not None:
            self.run_lock.release()
            self.run_lock = None

    def _stop_heartbeats(self) -> None:
        if self.heartbeats is not None:
            self.heartbeats.stop()
            self.heartbeats = None

    def _build_data(self) -> None:
        cfg, seed = self.cfg, self.cfg.trainer.seed
        if self.env.local_rank == 0:
            ensure_sample_dataset(cfg.data)
        if self.env.is_distributed:
            torch.distributed.barrier()
        # The policy says what its samples look like, and checks what the data yields, before it is built.
        cls = policy_class(cfg.policy)
        self.mixture = Mixture(cfg.data, cls.sample_spec(cfg.policy), seed)
        cls.check_data(cfg.policy, self.mixture.features)
        self.data = TrainData(self.mixture, cfg.data, self.micro_batch_size, self.env.rank, self.env.world_size, seed,
                              pin_memory=self.device.type == "cuda")
        self.damaged = DamageCount(cfg.data, self.mixture.episodes_per_epoch)
        self.val_loader = build_validation_loader(self.mixture, cfg.data, self.micro_batch_size, self.env.rank,
                                                  self.env.world_size)
        if self.env.is_main:
            for name, c in self.mixture.summary().items():
                log.info("data %s (%s): %d train / %d val episodes, %d samples per epoch, weight %.3f", name,
                         c["format"], c["train_episodes"], c["val_episodes"], c["samples_per_epoch"], c["weight"])
        self.step = 0
        self.epoch = 0
        self.batches_in_epoch = 0  # on this rank
        self._batches = None

    def _build_model(self) -> None:
        # policy.gradient_checkpointing=auto becomes a concrete setting here, the one the run saves.
        cfg = self.cfg = resolve_recompute(self.cfg, self.device, self.env)
        # The same seed on every rank: every rank builds identical initial weights.
        seed_everything(cfg.trainer.seed)
        stats = resolve_stats(cfg, self.mixture, announce=self.env.is_main)
        # A policy that can initialise parameter by parameter is built on the meta device and
        # materialised by the engine where it will live (a sharding engine: each rank's shard only;
        # slurmvla/engine/materialize.py): no fp32 copy of the model on the host first.
        self.policy = build_policy(cfg.policy, stats, on_meta=ENGINES.get(cfg.engine.name).deferred_init)
        self.engine = build_engine(cfg, self.env, self.device, self.micro_batch_size)
        # model: what forward calls (the policy, or a DDP / DeepSpeed wrapper of it); optimizer: the
        # one that actually steps.
        self.model, self.optimizer = self.engine.prepare(self.policy, cfg.optim)
        if cfg.trainer.compile:
            compile_units(self.policy, dynamic=None)
        # Built on the optimizer the engine returned, i.e. the one that actually steps.
        self.scheduler = build_scheduler(cfg.scheduler, self.optimizer, cfg.trainer.max_steps)
        self.ema = MovingAverage(self.engine, cfg.trainer.ema_decay) if cfg.trainer.ema_decay else None
        if self.ema is not None and self.env.is_main:
            log.info("moving average of the fp32 master weights, decay %g: %.1f MiB on rank 0", cfg.trainer.ema_decay,
                     self.ema.num_bytes() / 2**20)
        self._numerics_checked = False
        self._fields_checked = False
        # Per-rank streams for any randomness drawn outside the data pipeline (the training noise
        # itself comes with each sample).
        seed_everything(cfg.trainer.seed + 1_000 * (self.env.rank + 1))

    def _open_run_dir(self) -> None:
        self.checkpoints = CheckpointManager(self.run_dir, self.cfg.checkpoint.keep, self.engine, self,
                                             GlobalGenerators(self.device), self.ema, self.env.rank,
                                             self.env.world_size, self.cfg.checkpoint.async_save)
        config_dict = dataclasses.asdict(self.cfg)  # what OmegaConf.structured would give, at a tenth of the cost
        self.logger = MetricLogger(self.run_dir, self.cfg.logging.wandb, self.cfg.name, config_dict, self.env.is_main)
        if self.env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.resolved.yaml").write_text(OmegaConf.to_yaml(config_dict))
            write_run_format(self.run_dir)
            write_snapshot(self.run_dir, dataclasses.asdict(self.env), SlurmJob.from_environ().restart_count)

    def _open_evaluations(self) -> None:
        """``rollout_array.enabled``: rank 0 reads the run's evaluation arrays (a requeued run continues them), asks
        sbatch whether it would take one (``--test-only``: no sbatch, a partition or time the cluster refuses stop the
        run here, on every rank, not at the first evaluation), and keeps their checkpoints from rotation."""
        if not self.cfg.rollout_array.enabled:
            return
        problem: list = [None]
        if self.env.is_main:
            settings = ArraySettings.of(self.cfg.rollout_array)
            out_root = Path(self.cfg.rollout.out) if self.cfg.rollout.out else None
            try:
                problem[0] = check_submission(settings, self.run_dir, self.cfg.name)
                self.evaluations = EvalArrays(self.run_dir, settings, self.cfg.name, self.logger.log_at, out_root)
            except ValueError as e:
                problem[0] = str(e)
        if self.env.is_distributed:
            torch.distributed.broadcast_object_list(problem, src=0)
        if problem[0]:
            raise ValueError(problem[0])
        if self.evaluations is not None:
            self.checkpoints.protected = self.evaluations.pinned

    # -- data -------------------------------------------------------------------------------------

    def _next_batch(self, timer: PhaseMarks | None = None) -> dict[str, Any]:
        timer = timer or _NO_MARKS
        while True:
            if self._batches is None:
                self._batches = self.data.iterate(self.epoch, self.batches_in_epoch)
            try:
                batch = next(self._batches)
            except StopIteration:
                self.epoch, self.batches_in_epoch, self._batches = self.epoch + 1, 0, None
                continue
            self.batches_in_epoch += 1
            timer.mark("data wait")
            batch = to_device(self._host_part(self.damaged.take(batch)), self.device)
            timer.mark("host->device")
            return batch

    def _host_part(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The policy's host-side work on the batch before it moves (``prepare_training``: pi0.5 writes its
        prompt from the state), so the forward never waits on the device for values it needs on the host."""
        prepare = self.policy.prepare_training
        return batch if prepare is None else prepare(batch)

    # -- one optimizer step -----------------------------------------------------------------------

    def train_step(self, micro_batches: list[dict[str, Any]], timer: PhaseMarks | None = None) -> dict[str, torch.Tensor]:
        """Forward/backward every micro-batch, clip, step. Returns device tensors (no host sync).

        ``timer`` (the profiler's) gets a mark at the end of each phase; nothing waits on it here."""
        timer = timer or _NO_MARKS
        if not self._fields_checked:
            self._check_batch_fields(micro_batches[0])
        self.model.train()
        n = len(micro_batches)
        loss_sum = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro_batches):
            # Gradients are synchronised once, on the last micro-batch.
            sync = contextlib.nullcontext() if i == n - 1 else self.engine.no_sync()
            with sync:
                with self.engine.autocast():
                    out = self.model(batch)
                timer.mark("forward")
                self.engine.backward(out["loss"] / n)
                timer.mark("backward")
            loss_sum += out["loss"].detach()
        grad_norm = self.engine.clip_grad_norm()
        timer.mark("grad clip")
        self.engine.step()
        if self.ema is not None:
            self.ema.update()
        timer.mark("optimizer step + zero-grad")
        self.scheduler.step()
        timer.mark("scheduler")
        return {"loss": loss_sum / n, "grad_norm": grad_norm.detach()}

    def _check_batch_fields(self, batch: dict[str, Any]) -> None:
        """Every rank's first batch has the same fields, or every rank stops with the same ValueError
        naming the field and the ranks that have it. The policy reads the fields it was built for and
        raises on its own rank only: with peers already inside a sharded forward's collectives, that
        would be a hang until the timeout, not an error. One small collective, once: the data builds
        every batch to the policy's sample spec and the data config, so the first speaks for the rest."""
        check_same_fields(batch.keys())
        self._fields_checked = True

    def run_step(self, timer: PhaseMarks | None = None) -> dict[str, torch.Tensor]:
        """One optimizer step: take grad_accum_steps micro-batches, train on them, count the step."""
        micro = [self._next_batch(timer) for _ in range(self.cfg.trainer.grad_accum_steps)]
        metrics = self.train_step(micro, timer)
        self.step += 1
        if self.heartbeats is not None:
            self.heartbeats.step = self.step
        return metrics

    # -- the loop ---------------------------------------------------------------------------------

    def fit(self, stop_at: int | None = None) -> dict[str, float]:
        """Train to ``trainer.max_steps`` (or stop early at ``stop_at``, with a checkpoint there).

        A collective that fails (a peer stopped, its node lost: after ``engine.timeout_s``) is raised
        as CollectiveFailure naming the ranks that stopped reporting."""
        try:
            return self._fit(stop_at)
        except Exception as e:
            if self.heartbeats is None or not is_collective_failure(e):
                raise
            raise CollectiveFailure(f"a collective failed on rank {self.env.rank} at step {self.step} "
                                    f"(engine.timeout_s={self.cfg.engine.timeout_s}): {str(e).strip()[:300]}; "
                                    f"{self.heartbeats.diagnose()}") from e

    def _fit(self, stop_at: int | None) -> dict[str, float]:
        tcfg = self.cfg.trainer
        end = tcfg.max_steps if stop_at is None else min(stop_at, tcfg.max_steps)
        bar = tqdm(total=tcfg.max_steps, initial=self.step, desc="train", dynamic_ncols=True,
                   disable=not (self.env.is_main and tcfg.progress_bar))
        window = {"loss": 0.0, "grad_norm": 0.0, "steps": 0}
        last: dict[str, float] = {}
        t0 = time.perf_counter()
        self._fit_start = (t0, self.step)
        # A signal that came during start-up: nothing trained since the last checkpoint; stop now.
        self._preemption_agreed()
        while self.step < end and not self.stopped_for_requeue:
            lrs = {g.get("name", str(i)): g["lr"] for i, g in enumerate(self.optimizer.param_groups)}
            metrics = self.run_step()
            if not self._numerics_checked:
                check_fp32_master_state(self.optimizer)
                self._numerics_checked = True
            window["steps"] += 1
            window["loss"] += metrics["loss"]
            window["grad_norm"] += metrics["grad_norm"]
            bar.update(1)
            if self.step % tcfg.log_every_steps == 0 or self.step == tcfg.max_steps:
                elapsed = time.perf_counter() - t0
                last = self._record(window, lrs, elapsed)
                bar.set_postfix(loss=f"{last['loss']:.4f}", lr=f"{last['lr']:.2e}")
                window = {"loss": 0.0, "grad_norm": 0.0, "steps": 0}
                t0 = time.perf_counter()
            if self._validation_due():
                self.validate()  # agrees on a stop at every batch: a signal ends the pass
                if self.stopped_for_requeue:
                    break
            evaluate = self._rollout_due()
            off_job = evaluate and self.cfg.rollout_array.enabled
            if evaluate and not off_job:
                self.closed_loop()
            if off_job or (self.cfg.checkpoint.every_steps and self.step % self.cfg.checkpoint.every_steps == 0):
                if off_job and self.evaluations is not None:
                    # Recorded before the save: rotation keeps this checkpoint until its array is gathered.
                    self.evaluations.plan(self.step, self.checkpoints.root / f"step_{self.step:08d}")
                self.save()
            if self.evaluations is not None and (off_job or self.step % tcfg.log_every_steps == 0):
                self.evaluations.poll()  # submits a committed checkpoint's array, logs the gathered ones
            if self.step % tcfg.signal_check_every_steps == 0 and self._preemption_agreed():
                break
        bar.close()
        self.checkpoints.wait()
        latest = self.checkpoints.latest()
        if self.step > 0 and (latest is None or latest.name != f"step_{self.step:08d}"):
            self.save()
        self.checkpoints.wait()
        if self.stopped_for_requeue and self.env.is_main:
            self._say_stopped()
        if self.step >= tcfg.max_steps and self.env.is_main:
            (self.run_dir / FINISHED_MARKER).write_text(f"{self.step}\n")
        if self.cfg.rollout_array.enabled:
            self._gather_evaluations(wait=self.step >= tcfg.max_steps and not self.stopped_for_requeue)
        return last

    def _validation_due(self) -> bool:
        every = self.cfg.trainer.val_every_steps
        return bool(every and self.val_loader is not None
                    and (self.step % every == 0 or self.step == self.cfg.trainer.max_steps))

    def validate(self) -> dict[str, float] | None:
        """One pass over the validation split on every rank; rank 0 logs and returns the metrics."""
        if self.env.is_main:
            log.info("step %d: validation over %d samples per rank", self.step, len(self.val_loader.dataset))
        metrics = validate(self.model, self.val_loader, self.device, self.mixture, self.engine.autocast,
                           should_stop=self._preemption_agreed, host_part=self._host_part)
        if self.stopped_for_requeue:
            if self.env.is_main:
                log.warning("validation at step %d abandoned for the stop signal", self.step)
            return None
        if metrics is not None:
            self.logger.log(self.step, metrics)
            log.info("step %d: val/loss %.4f over %d samples", self.step, metrics.get("val/loss", float("nan")),
                     int(metrics["val/num_samples"]))
        return metrics

    def _rollout_due(self) -> bool:
        every = self.cfg.trainer.rollout_every_steps
        return bool(every and (self.step % every == 0 or self.step == self.cfg.trainer.max_steps))

    def closed_loop(self) -> dict[str, float] | None:
        """``rollout.episodes`` closed-loop episodes split over the ranks, each rank's share against its own
        copy of the policy through the server and openpi's client (slurmvla.inference.closed_loop); rank 0 logs
        ``rollout/*`` and the closed loop writes RUN_DIR/rollout/step_N/."""
        if self.env.is_main:
            log.info("step %d: %d closed-loop episodes over %d rank(s)", self.step, self.cfg.rollout.episodes,
                     self.env.world_size)
        # serve.weights: the moving average, where the run keeps one, unless the trained weights are asked for.
        average = self.ema is not None and self.cfg.serve.weights != "trained"
        self.policy.eval()
        try:
            with self.ema.applied_to(self.policy) if average else contextlib.nullcontext():
                metrics = self._closed_loop(self.policy, self.cfg, self.step, self.run_dir, self.env.rank,
                                            self.env.world_size, weights="ema" if average else "trained")
        finally:
            self.policy.train()
        if metrics is not None:
            self.logger.log(self.step, metrics)
            log.info("step %d: rollout/success_rate %.3f (95%% CI %.3f-%.3f) over %d episodes", self.step,
                     metrics["rollout/success_rate"], metrics["rollout/success_ci95_low"],
                     metrics["rollout/success_ci95_high"], metrics["rollout/episodes"])
        return metrics

    def _gather_evaluations(self, wait: bool) -> None:
        """Every rank, after the last save: rank 0 gathers the arrays still running (up to ``rollout_array.wait_s``
        when training is over) while the others wait with it (one small all-reduce a second: none meets the shutdown
        barrier before rank 0 is done), until a stop signal on any rank; then rank 0 prunes the checkpoints they
        released and names what is still pending. A run stopped for requeue does not wait: the state file holds its
        arrays for the resumed run."""
        settings = self.cfg.rollout_array
        arrays = self.evaluations
        deadline = time.monotonic() + (settings.wait_s if wait else 0.0)
        if wait and arrays is not None and arrays.pending():
            log.info("training finished; waiting up to %g s for %d evaluation array(s)", settings.wait_s,
                     len(arrays.pending()))
        while True:
            busy = False
            if arrays is not None:
                arrays.poll()
                busy = bool(arrays.pending()) and time.monotonic() < deadline
            agreed = agree({"busy": busy, "stop": self.preempt.is_set()})
            if not agreed["busy"] or agreed["stop"]:
                break
            time.sleep(min(1.0, settings.poll_s))
        if arrays is None:
            return
        self.checkpoints.prune()
        if pending := arrays.pending():
            log.warning("evaluations still pending: %s; python -m slurmvla.eval_array gather %s logs them at their "
                        "steps once they finish%s", arrays.describe(pending), self.run_dir,
                        "" if self.stopped_for_requeue else " (the checkpoints they read are kept until then)")

    def _preemption_agreed(self) -> bool:
        """All ranks stop at the same point if any rank got the signal (then ``fit`` saves and returns).
        A collective: every rank calls it at the same step, or validation batch."""
        if self.stopped_for_requeue:
            return True
        stop = agree({"stop": self.preempt.is_set()})["stop"]
        if stop:
            self.stopped_for_requeue = True
            self.preempt.adopt(gather_objects(self.preempt.report()))  # once per run, at the stop
            if self.env.is_main:
                log.warning("preemption signal %s (%s, %.1f s ago) at step %d: all ranks checkpoint for requeue",
                            "on another rank" if self.preempt.elsewhere else "here", self.preempt.signal_name,
                            self._signal_age(), self.step)
        return stop

    def _signal_age(self) -> float:
        """Seconds since the stop signal came: this rank's own, or the earliest rank's (``PreemptionFlag.adopt``)."""
        return time.monotonic() - self.preempt.received_at

    def _say_stopped(self) -> None:
        latest = self.checkpoints.latest()
        saved = f"checkpoint {latest} complete" if latest is not None else "no checkpoint (nothing trained yet)"
        log.warning("stopped at step %d, %.1f s after %s%s: %s; exiting for requeue", self.step, self._signal_age(),
                    self.preempt.signal_name, " on another rank" if self.preempt.elsewhere else "", saved)

    def _record(self, window: dict, lrs: dict[str, float], elapsed: float) -> dict[str, float]:
        steps = window["steps"]
        metrics = {
            "loss": float(window["loss"]) / steps,
            "grad_norm": float(window["grad_norm"]) / steps,
            "samples_per_s": steps * self.cfg.trainer.global_batch_size / max(elapsed, 1e-9),
            "epoch": self.epoch,
            "damaged_episodes": self.damaged.reduce(self.epoch),  # every rank's, since the last record
        }
        distinct = set(lrs.values())
        metrics["lr"] = max(distinct)
        if len(distinct) > 1:
            metrics.update({f"lr/{name}": lr for name, lr in lrs.items()})
        self.logger.log(self.step, metrics)
        return metrics

    # -- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where training stands (a checkpoint's ``trainer_state.pt``); the engine, the moving average and
        each rank's generators are the checkpoint's other parts (``CheckpointManager``)."""
        return {
            "step": self.step,
            "epoch": self.epoch,
            "data": {"batches_in_epoch": self.batches_in_epoch, "layout": self.data.layout,
                     "damaged": self.damaged.state_dict()},
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.epoch = state["step"], state["epoch"]
        self.batches_in_epoch = self.data.resume_position(state["data"])
        self.damaged.load_state_dict(state["data"].get("damaged"))
        self.scheduler.load_state_dict(state["scheduler"])
        self._batches = None

    def save(self) -> Path:
        path = self.checkpoints.save(self.step)
        if self.env.is_main and not self.checkpoints.pending:
            log.info("saved checkpoint %s", path)  # a background save says so when it is in place
        self._check_grace(self.checkpoints.last_save_seconds)
        return path

    def _check_grace(self, save_s: float | None) -> None:
        """Once per run, on rank 0, with the first measured save: warn when a stop for a signal
        (agreement, a save in flight, the checkpoint) does not fit in the time SLURM gives."""
        if not self.env.is_main or save_s is None or self._grace_checked:
            return
        self._grace_checked = True
        started, first_step = self._fit_start or (0.0, self.step)
        steps = self.step - first_step
        step_s = (time.perf_counter() - started) / steps if steps > 0 else 0.0
        for warning in shortfalls(save_s, step_s, self.cfg.trainer.signal_check_every_steps,
                                  self.checkpoints.background):
            log.warning("%s", warning)

    def _resume(self) -> None:
        latest = self.checkpoints.load()
        if latest is None:
            return
        self.resumed_from = latest
        if self.env.is_main:
            log.info("resumed from %s at step %d", latest, self.step)
        # The save this run will make takes about what the last one took: say now if it cannot fit.
        try:
            self._check_grace(json.loads((latest / "meta.json").read_text()).get("save_seconds"))
        except (OSError, ValueError):
            pass

    def close(self, failed: bool = False, keep_process_group: bool = False) -> None:
        # A save already captured is finished, also after a failure elsewhere: it is complete data.
        error = self.checkpoints.join()
        if error:
            log.error("%s", error)
        self._unlock_run_dir()
        self._stop_heartbeats()
        self.preempt.uninstall()
        self.logger.close()
        self._batches = None
        self.data.close()
        # Objects alive at start-up or when the data workers were forked were frozen (slurmvla.garbage_collector);
        # the run is over: let the collector reach them again (the engine's wrappers among them, which
        # must go before the process group).
        garbage_collector.thaw()
        if not keep_process_group:
            if torch.distributed.is_initialized():
                # The DDP / FSDP / DeepSpeed objects hold the process group's communicators: let them
                # go before the group is destroyed, not at interpreter exit after it.
                self.model = self.engine = self.optimizer = self.scheduler = self.ema = None
                gc.collect()
            shutdown_process_group(failed)
