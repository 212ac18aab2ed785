"""A policy's processor: a robot's observation -> the policy's batch, a recorded chunk -> what the policy trains on,
the policy's chunk -> commands. One object, built from the run's config and the policy's sample spec
(:meth:`Processor.of`), called by every path in and out of a policy: training's samples
(:class:`slurmvla.data.source.LeRobotSource`), the server's runner (:mod:`slurmvla.inference.runner`: inputs ->
sample -> outputs), open-loop evaluation, the closed loop through the server, and the latency benchmarks. The
conventions it owns are written here once:

- the client's keys (``serve.cameras`` / ``serve.state`` / ``serve.prompt``; openpi's DROID client's by default)
  and what each must hold;
- the images at the policy's size (``data.image_resize``: pad or squash, as training decodes them), a padded and
  masked frame for a camera the client does not send;
- the prompt as the policy's tokens (its sample spec's tokenizer);
- the observation history a policy reads (``data.history_interval`` apart, the frames before the first masked);
- delta actions (``data.delta_actions``): recorded chunks and a previous chunk to the policy's units
  (:meth:`Processor.to_policy`), its chunks back to absolute commands (:meth:`Processor.to_commands`).

State and action normalization is not here: the policy owns it (offset / scale buffers that travel with its
weights), so raw state goes in and raw actions come out on every path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from slurmvla.data.delta import current_state, delta_dims, to_absolute, to_delta
from slurmvla.data.prepare import observation_batch, prepare_image, text_fields
from slurmvla.data.spec import SampleSpec

if TYPE_CHECKING:
    from slurmvla.config import Config
    from slurmvla.config.data import DataConfig
    from slurmvla.config.serve import ServeConfig


@dataclass(frozen=True)
class Observation:
    """One request, read: a prepared image per camera (None for one the client does not send), the raw state,
    the prompt."""

    images: list[np.ndarray | None]
    state: np.ndarray
    prompt: str


def as_array(key: str, value: object) -> np.ndarray:
    """A request's ``value`` of ``key`` as an array; a ValueError names the key (numpy's says only that a nested
    list is ragged, or its integers overflow)."""
    try:
        return np.asarray(value)
    except (ValueError, TypeError, OverflowError) as e:
        raise ValueError(f"{key}: expected an array of numbers, got a {type(value).__name__} numpy cannot read as one "
                         f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


class Processor:
    """The conventions between a robot (or a dataset) and one policy. ``data``: the run's data options;
    ``spec``: the policy's sample spec; ``serve``: the client's keys (None: a processor for training's samples,
    which reads no requests); ``state_dim`` / ``image_size``: the policy's state width and configured image size
    (for checking a request's state, and the frame of a policy that resizes images itself)."""

    def __init__(self, data: DataConfig, spec: SampleSpec, serve: ServeConfig | None = None,
                 state_dim: int | None = None, image_size: int | None = None):
        self.spec = spec
        self.delta_flags = list(data.delta_actions) if data.delta_actions else []
        self.image_resize = data.image_resize
        # Requests between two history frames: a connection's requests come serve.request_interval steps apart
        # (a divisor of data.history_interval where there is history: the config checks it at start-up).
        self.request_stride = data.history_interval // (serve.request_interval if serve else 1)
        # How many past observations (this one included) the batch reads.
        self.history = self.request_stride * (spec.num_obs_history - 1) + 1
        self.serve, self.state_dim, self.image_size = serve, state_dim, image_size
        self.camera_keys: list[str | None] = []
        if serve is not None:
            cameras = list(data.cameras)
            if len(serve.cameras) != len(cameras):
                raise ValueError(f"serve.cameras={list(serve.cameras)} has {len(serve.cameras)} entries but the policy "
                                 f"reads {len(cameras)} cameras (data.cameras={cameras}); give one client key (or null "
                                 "for a camera the client does not send) per camera, in that order")
            self.camera_keys = list(serve.cameras)

    @classmethod
    def of(cls, cfg: Config, spec: SampleSpec) -> Processor:
        """The processor of a run's config (``cfg``) for the policy whose sample spec is ``spec``."""
        return cls(cfg.data, spec, cfg.serve, cfg.policy.state_dim, cfg.policy.image_size)

    # -- actions ------------------------------------------------------------------------------------------------

    @property
    def delta_dims(self) -> list[int]:
        """The action dims the policy predicts relative to the state (``data.delta_actions``)."""
        return delta_dims(self.delta_flags)

    def to_policy(self, actions, state):  # noqa: ANN001, ANN201 - numpy or torch, as given
        """Absolute actions ``[..., H, A]`` (a recorded chunk, a previous chunk) in the policy's units: ``state``
        (``[..., S]``, the observation the chunk starts from) subtracted on the delta dims; unchanged without any."""
        return to_delta(actions, state, self.delta_flags) if self.delta_flags else actions

    def to_commands(self, chunk, state):  # noqa: ANN001, ANN201 - numpy or torch, as given
        """The policy's chunk ``[..., H, A]`` as absolute commands: ``state`` added back on the delta dims (a
        batch of observation histories ``[B, T, S]`` is relative to its last); unchanged without any."""
        return to_absolute(chunk, current_state(state), self.delta_flags) if self.delta_flags else chunk

    # -- the prompt -----------------------------------------------------------------------------------------------

    def tokens(self, instruction: str) -> dict[str, torch.Tensor]:
        """``text`` / ``text_mask`` from the policy's tokenizer; nothing for a policy without one."""
        return text_fields(self.spec, instruction)

    # -- requests -----------------------------------------------------------------------------------------------

    def read(self, obs: object) -> Observation:
        """One request's prepared images, raw state and prompt; a ValueError names the key and what was expected."""
        serve = self.serve
        if serve is None:
            raise ValueError("this processor reads no requests: build it with the client's keys (Processor.of)")
        if not isinstance(obs, dict):
            raise ValueError(f"a request must be a dict of observations, got {type(obs).__name__}")
        needed = [k for k in self.camera_keys if k] + list(serve.state) + [serve.prompt]
        missing = [k for k in needed if k not in obs]
        if missing:
            raise ValueError(f"missing key {missing[0]!r}: this server reads {needed}; the request has "
                             f"{sorted(map(str, obs))}")
        size = self.spec.image_size
        images = [None if key is None else prepare_image(obs[key], size, name=key, mode=self.image_resize)
                  for key in self.camera_keys]
        parts = []
        for key in serve.state:
            value = as_array(key, obs[key])
            if value.dtype.kind not in "biuf":
                raise ValueError(f"{key}: expected numbers, got dtype {value.dtype}")
            with np.errstate(over="ignore"):  # beyond float32 is inf, refused below: no warning per request
                parts.append(value.astype(np.float32).reshape(-1))
        state = np.concatenate(parts)
        if self.state_dim is not None and state.shape[0] != self.state_dim:
            got = ", ".join(f"{k}: {p.shape[0]}" for k, p in zip(serve.state, parts))
            raise ValueError(f"state keys {list(serve.state)} give {state.shape[0]} values ({got}); the policy's state "
                             f"has {self.state_dim} (policy.state_dim)")
        if not np.isfinite(state).all():
            raise ValueError(f"state keys {list(serve.state)} hold NaN or inf: {state.tolist()}")
        prompt = obs[serve.prompt]
        if isinstance(prompt, bytes):
            prompt = prompt.decode("utf-8", errors="replace")
        if not isinstance(prompt, str):
            raise ValueError(f"{serve.prompt}: expected a string, got {type(prompt).__name__}")
        return Observation(images, state, prompt)

    def batch(self, past: Sequence[Observation]) -> dict:
        """The policy's batch of one from a connection's observations (newest last): the history frames training
        would take, the ones before the first observation masked (as in training)."""
        n, interval = self.spec.num_obs_history, self.request_stride
        images, mask, states = [], [], []
        shape = self._frame_shape(past)
        for k in range(n - 1, -1, -1):
            i = len(past) - 1 - k * interval
            ok = i >= 0
            seen = past[max(i, 0)]
            for img in seen.images:
                images.append(np.zeros(shape, np.uint8) if img is None else img)
                mask.append(ok and img is not None)
            states.append(seen.state)
        state = states[0] if n == 1 else np.stack(states)
        return observation_batch(images, mask, state, past[-1].prompt, self.spec)

    def _frame_shape(self, past: Sequence[Observation]) -> tuple[int, int, int]:
        """One frame's shape: the policy's size, or (a policy that resizes frames itself) the size the client
        sent, which every camera of every kept observation must share."""
        if self.spec.image_size is not None:
            return (self.spec.image_size,) * 2 + (3,)
        shapes = {img.shape for seen in past for img in seen.images if img is not None}
        if len(shapes) > 1:
            keys = [k for k in self.camera_keys if k]
            raise ValueError(f"the images of {keys} differ in size ({sorted(shapes)}); this policy resizes them itself "
                             "and needs one size per request: send every camera at one size (e.g. 224 x 224)")
        return next(iter(shapes), (self.image_size,) * 2 + (3,))
