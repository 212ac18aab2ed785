"""A loaded policy as something that answers observations: openpi's client keys -> the policy's batch
-> an action chunk in dataset units. :class:`PolicyRunner` is what :class:`slurmvla.inference.server.PolicyServer`
serves (``infer(obs) -> {"actions"}``, ``metadata()``, ``session()`` per connection, ``max_request_bytes``);
the closed loop and the benchmarks drive it too.

Observations map to the policy's inputs, and its chunks to commands, through the policy's processor
(:class:`slurmvla.data.processor.Processor`: ``serve.*`` keys, images, prompt, history, delta actions), the one
training's samples and open-loop evaluation use.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import threading
import zlib
from typing import Any

import numpy as np
import torch

from slurmvla.data.processor import Observation, Processor, as_array
from slurmvla.inference.load import Loaded
from slurmvla.policy.base import seeded_sample_actions, supports_rtc
from slurmvla.policy.rtc import Guidance
from slurmvla.units import MiB

# The default request-size limit (default_max_request_bytes): each camera counted as at least one
# 1280 x 720 RGB uint8 frame (a raw camera frame; DROID's are 180 x 320, openpi's clients send
# 224 x 224), 64 KiB of prompt, times MARGIN, plus HEADROOM.
CAMERA_FRAME_BYTES = 1280 * 720 * 3
PROMPT_BYTES = 64 * 1024
MARGIN = 4
HEADROOM = 16 * 2**20


class PolicyRunner:
    """The loaded policy and the mapping from client keys to its inputs. Thread-safe: requests are
    prepared concurrently, the model runs one request at a time. ``infer(obs)`` answers one observation
    alone; a :meth:`session` keeps one connection's past observations (a policy with observation history
    reads them)."""

    def __init__(self, loaded: Loaded, sampler: Any = None):
        cfg = loaded.cfg
        self.loaded, self.cfg = loaded, cfg
        self.policy = loaded.policy
        self.device = next(iter(self.policy.parameters()), torch.empty(0)).device
        self.spec = type(self.policy).sample_spec(cfg.policy)
        # Requests in, chunks out: the client's keys, images, prompt, history and delta actions.
        self.processor = Processor.of(cfg, self.spec)
        self.lock = threading.Lock()
        self.fresh = np.random.default_rng()  # serve.seed=null: a new noise seed per request
        autocast = cfg.precision == "bf16" and self.device.type == "cuda"
        self.autocast = (lambda: torch.autocast("cuda", torch.bfloat16)) if autocast else None
        # What sample_actions is called on: the policy, or (build_runner, under serve.cuda_graph) its graphs.
        self.sampler = sampler if sampler is not None else self.policy
        self.rtc = supports_rtc(self.policy) and supports_rtc(self.sampler)

    def metadata(self) -> dict:
        pc = self.cfg.policy
        return {
            "server": "slurmvla", "policy": pc.target or pc.name, "step": self.loaded.step, "source": self.loaded.source,
            "weights": self.loaded.weights,
            "action_horizon": pc.action_horizon, "action_dim": pc.action_dim, "image_size": self.spec.image_size,
            "cameras": {cam: key for cam, key in zip(self.cfg.data.cameras, self.processor.camera_keys)},
            "state": list(self.cfg.serve.state), "prompt": self.cfg.serve.prompt, "seed": self.cfg.serve.seed,
            "max_request_bytes": self.max_request_bytes,
            "execution_modes": ["sync", "async", "rtc"] if self.rtc else ["sync", "async"],
            # The policy predicts these action dims relative to the observed state (data.delta_actions); the
            # chunk sent back has the state added again, so every dim is an absolute command.
            "delta_action_dims": self.processor.delta_dims,
            **({"rtc": self.rtc_metadata()} if self.rtc else {}),
        }

    def rtc_metadata(self) -> dict:
        """How an ``rtc`` request is answered: by inference-time guidance towards the previous chunk (its
        ``max_guidance`` and ``schedule``), or, for a policy trained with training-time RTC, by conditioning on
        the previous chunk's first ``delay`` actions (``prefix``; the delays it was trained on)."""
        trained = self.cfg.policy.rtc_training
        if trained.enabled:
            return {"method": "prefix", "trained_delays": [trained.min_delay, trained.max_delay]}
        serve = self.cfg.serve
        return {"method": "guidance", "max_guidance": serve.rtc_max_guidance, "schedule": serve.rtc_schedule,
                "jacobian": serve.rtc_jacobian, "guided_dims": serve.rtc_guided_dims}

    def observation_bytes(self, camera_bytes: int = 0) -> int:
        """One observation's size on the wire, roughly: every camera the client sends at the policy's
        image size (or ``camera_bytes``, whichever is larger), the state as float64, the prompt."""
        size = self.spec.image_size or self.cfg.policy.image_size or 0
        per_camera = max(size * size * 3, camera_bytes)
        cameras = sum(1 for key in self.processor.camera_keys if key)
        return cameras * per_camera + 8 * self.cfg.policy.state_dim + PROMPT_BYTES

    @property
    def max_request_bytes(self) -> int:
        """The largest request accepted: ``serve.max_request_mb``, else :func:`default_max_request_bytes`."""
        mb = self.cfg.serve.max_request_mb
        return int(mb * MiB) if mb is not None else default_max_request_bytes(self)

    def read_rtc(self, obs: dict, state: np.ndarray | None = None) -> Guidance | None:
        """Real-time chunking's optional keys: ``prev_actions`` ``[k, action_dim]`` (the previous chunk from the
        observation's step on, dataset units: absolute commands, as the server sent them) and ``delay`` d (its
        first d actions execute while this request is answered). None without them (or with ``delay`` 0 alone):
        the plain chunk. Under ``data.delta_actions`` the guidance is in the policy's delta units, relative to
        ``state`` (the request's raw state, :meth:`Processor.read`), which must then be given. A ValueError names the key
        and what was expected."""
        pc = self.cfg.policy
        horizon = pc.action_horizon
        prev, delay = obs.get("prev_actions"), obs.get("delay", 0)
        if isinstance(delay, np.ndarray) and delay.ndim == 0:
            delay = delay.item()
        if isinstance(delay, bool) or not isinstance(delay, (int, np.integer)):
            raise ValueError(f"delay: expected an integer number of control steps >= 0, got {delay!r}")
        delay = int(delay)
        if prev is None:
            if delay != 0:
                raise ValueError(f"delay={delay} without prev_actions: send the previous chunk's remaining actions "
                                 f"as prev_actions [k, {pc.action_dim}] with it")
            return None
        if not self.rtc:
            raise ValueError(f"prev_actions: this server's policy ({pc.target or pc.name}) does not support real-time "
                             "chunking (its metadata's execution_modes has no 'rtc'); send requests without it")
        prev = as_array("prev_actions", prev)
        if prev.dtype.kind not in "biuf" or prev.ndim != 2 or prev.shape[1] != pc.action_dim \
                or not 1 <= prev.shape[0] <= horizon:
            raise ValueError(f"prev_actions: expected numbers shaped [k, {pc.action_dim}] with 1 <= k <= {horizon} "
                             f"(policy.action_horizon), got dtype {prev.dtype} shape {list(prev.shape)}")
        # Checked as the policy reads them, float32: a float64 beyond its range (1e39) would be inf there.
        with np.errstate(over="ignore"):
            prev = prev.astype(np.float32)
        if not np.isfinite(prev).all():
            raise ValueError("prev_actions hold NaN or inf (or values beyond float32's range)")
        k = prev.shape[0]
        if not 0 <= delay <= k or delay >= horizon:
            raise ValueError(f"delay={delay}: expected 0 <= delay <= {k} (the rows of prev_actions) and delay < "
                             f"{horizon} (policy.action_horizon)")
        padded = np.zeros((1, horizon, pc.action_dim), np.float32)
        padded[0, :k] = prev
        if self.processor.delta_flags:
            if state is None:
                raise ValueError("prev_actions: this policy predicts delta actions (data.delta_actions); pass the "
                                 "request's state to read_rtc to express the previous chunk relative to it")
            padded[0, :k] = self.processor.to_policy(padded[0, :k], state)
        serve = self.cfg.serve
        return Guidance(torch.from_numpy(padded), torch.tensor([delay]), torch.tensor([k]),
                        serve.rtc_max_guidance, serve.rtc_schedule, serve.rtc_jacobian,
                        None if serve.rtc_guided_dims is None else tuple(serve.rtc_guided_dims))

    def infer(self, obs: Any) -> dict:
        """``{"actions": chunk}`` for one observation with no past (openpi's ``BasePolicy.infer``)."""
        return self.session().infer(obs)

    def session(self) -> Session:
        """One client's conversation: its observations, kept as far back as the policy's history reaches."""
        return Session(self)

    @torch.no_grad()
    def act(self, batch: dict, rtc: Guidance | None = None) -> np.ndarray:
        """The policy's action chunk ``[action_horizon, action_dim]`` float32 in dataset units (deltas where
        ``data.delta_actions`` says; :meth:`Processor.to_commands` turns them into commands). Noise is drawn on the
        CPU, seeded by ``serve.seed`` and the request's batch (:func:`request_seed`): the same observation always
        gives the same chunk, on any server and device (up to the device's precision), and different observations
        draw unrelated noise. ``serve.seed=null``: fresh noise for each request (as openpi's server), from a
        generator seeded once from the OS. ``rtc``: guided towards a previous chunk (:meth:`read_rtc`), from the
        same noise."""
        seed = (request_seed(self.cfg.serve.seed, batch) if self.cfg.serve.seed is not None
                else int(self.fresh.integers(2**62)))
        batch = {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
        rtc = None if rtc is None else rtc.to(self.device)
        with self.lock, (self.autocast() if self.autocast is not None else contextlib.nullcontext()):
            actions = seeded_sample_actions(self.sampler, self.spec, batch, seed, rtc)
        return actions[0].float().cpu().numpy()


def request_seed(seed: int, batch: dict) -> int:
    """The noise seed of one request: ``serve.seed`` mixed with everything the policy reads (every tensor of the
    batch: images, masks, state, prompt tokens; and the instruction), so the same observation always draws the same
    noise and two different ones draw unrelated noise. One fixed draw for every request would be a bias that never
    averages out: in closed loop every chunk would start from the same point of the noise (on the simulated pick
    task, sync replanning every 4 of 8 actions solved 0.24 with serve.seed=0 drawn once, 0.98 seeded by each
    observation: docs/benchmarks.md#the-noise-of-each-request)."""
    h = hashlib.blake2b(str(seed).encode(), digest_size=8)
    for key in sorted(batch):
        value = batch[key]
        h.update(key.encode())
        if torch.is_tensor(value):
            flat = value.detach().cpu().contiguous().reshape(-1)
            h.update(f"{tuple(value.shape)}{value.dtype}".encode())
            h.update(zlib.crc32(flat.view(torch.uint8).numpy()).to_bytes(4, "little"))  # ~0.1 ms for 3 x 224^2 RGB
        else:
            h.update(repr(value).encode())
    return int.from_bytes(h.digest(), "little") >> 2


class Session:
    """One connection's past observations (newest last) and the runner that answers them."""

    def __init__(self, runner: PolicyRunner):
        self.runner = runner
        self.past: collections.deque[Observation] = collections.deque(maxlen=runner.processor.history)

    def infer(self, obs: Any) -> dict:
        """``{"actions": chunk}`` for ``obs`` after this session's earlier observations: inputs -> sample ->
        outputs. A ValueError (the observation is kept out of the history then) names the key and what was
        expected."""
        processor = self.runner.processor
        observation = processor.read(obs)
        # The chunk's deltas (and a previous chunk's) are relative to this observation's state.
        rtc = self.runner.read_rtc(obs, observation.state)
        self.past.append(observation)
        chunk = self.runner.act(processor.batch(self.past), rtc)
        return {"actions": processor.to_commands(chunk, observation.state)}


def default_max_request_bytes(runner: PolicyRunner) -> int:
    """The default request-size limit: ``MARGIN`` (4) x one observation, each camera the client sends
    counted at the policy's image size or as a raw 1280 x 720 RGB uint8 camera frame, whichever is
    larger, plus the state (float64) and 64 KiB of prompt; plus ``HEADROOM`` (16 MiB). For openpi's
    DROID client (2 cameras) that is about 37 MiB; ``serve.max_request_mb`` sets another limit."""
    return MARGIN * runner.observation_bytes(CAMERA_FRAME_BYTES) + HEADROOM


# -- API key ------------------------------------------------------------------------------------
