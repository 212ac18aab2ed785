"""The policy server's options (``serve.*``: ``python -m slurmvla.serve``, ``slurmvla.inference``'s runner and server)
and how action chunks run on the robot's side (``EXECUTION_MODES``: ``slurmvla.inference.executor``, ``rollout.execution``).
A schema module of ``slurmvla.config``: it imports no torch and nothing of ``slurmvla`` above the configuration
(layer 1; docs/architecture.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from slurmvla.config.policy import RTC_JACOBIANS, RTC_SCHEDULES

# rollout.execution and the robot-side executor (slurmvla/inference/executor.py): how action chunks run.
EXECUTION_MODES = ("sync", "async", "rtc")
# serve.weights: which of a checkpoint's weights a policy is served (and evaluated, rolled out, exported) with.
SERVED_WEIGHTS = ("auto", "trained", "ema")


@dataclass
class ServeConfig:
    """python -m slurmvla.serve: where it listens, and which client keys feed which policy input.

    The defaults are what openpi's DROID client sends: one exterior camera, the wrist camera, the 7
    joint positions, the gripper position and the prompt."""

    host: str = "0.0.0.0"
    port: int = 8000
    # One client key per entry of data.cameras, in that order; null: the client never sends that
    # camera, so it is padded black and masked, as data.missing_cameras=pad does in training.
    cameras: list[str | None] = field(
        default_factory=lambda: ["observation/exterior_image_1_left", None, "observation/wrist_image_left"])
    # Client keys concatenated (in this order) into the policy's raw state (data.state_keys).
    state: list[str] = field(default_factory=lambda: ["observation/joint_position", "observation/gripper_position"])
    prompt: str = "prompt"
    # Each request samples its action chunk from noise seeded by this and the observation itself
    # (slurmvla.inference.runner.request_seed): the same observation always gives the same chunk, on any
    # server, and consecutive observations in closed loop draw unrelated noise. null: fresh noise per
    # request (openpi's server), not reproducible.
    seed: int | None = 0
    # Control steps between one connection's requests: a client that asks for a chunk every k steps (running k of
    # its actions) sends every k-th frame, so a policy with observation history, trained on frames
    # data.history_interval steps apart, reads the request data.history_interval / k back (it must divide). 1: each
    # request is the next frame. python -m slurmvla.rollout sends one every rollout.replan_steps.
    request_interval: int = 1
    # Which weights: ema, the moving average a run with trainer.ema_decay keeps (what openpi serves and
    # Diffusion Policy evaluates); trained, the optimizer's own; auto, the average where the checkpoint holds
    # one (ema.safetensors), else the trained weights. The trainer's periodic closed loop follows it too.
    weights: str = "auto"
    # auto: the GPU when there is one.
    device: str = "auto"
    # Real-time inference on a GPU (slurmvla/inference/graphs.py). cuda_graph: each request replays one
    # CUDA graph of the whole sample_actions (captured per input shape on first use; pi0 / pi0.5).
    # compile: torch.compile the policy's repeated layers first (a one-time compilation at the first
    # request of each shape; fused kernels).
    cuda_graph: bool = False
    compile: bool = False
    # pi0 / pi0.5: each layer's query / key / value projections, and its MLP's gate / up projections, run
    # as one matrix product each (the same weights, not copied; slurmvla.inference.optimize.fuse_linears).
    fused_projections: bool = True
    # pi0 / pi0.5 on a GPU with FP8 matrix units (compute capability >= 8.9: L40S, RTX 4090, H100, H200), bf16:
    # the prefix's linear layers (vision tower, projector, the backbone's half of each layer; run once per
    # request) in float8 with per-row scales through torchao (pip install -e '.[fp8]'); the denoising steps stay
    # bf16. The actions move by float8's rounding (slurmvla/inference/fp8.py, tests/inference/test_fp8.py).
    fp8_prefix: bool = False
    # The largest request (one msgpack frame) accepted, in MiB; a larger one is refused as its header
    # arrives (close code 1009), before any of it is buffered. null: derived from the policy (see
    # slurmvla.inference.runner.default_max_request_bytes): 4 x one observation, each camera counted at the
    # policy's image size or 1280 x 720 RGB, whichever is larger, plus 16 MiB.
    max_request_mb: float | None = None
    # Overload gets an answer, never an unbounded backlog (slurmvla.inference.server). max_connections:
    # connections served at once; one more is refused at the handshake with HTTP 503 naming this option.
    # max_pending: requests being answered or waiting for the policy at once, over all connections; one more
    # gets a text frame naming this option and its connection closes with code 1013 (try again later).
    max_connections: int = 64
    max_pending: int = 32
    # API key (clients send "Authorization: Api-Key <key>", openpi's WebsocketClientPolicy(..., api_key=...)).
    # The NAME of an environment variable holding the key; the default one may be unset (no key
    # from it), any other name must be set. null: no key from the environment.
    api_key_env: str | None = "SLURMVLA_API_KEY"
    # A file whose content is the key (readable only by its owner); must be readable when set.
    # The key itself is never part of the config, so it never reaches config.resolved.yaml.
    api_key_file: str | None = None
    # Without a key, a server on an address beyond this machine (serve.host not 127.0.0.1 / ::1 / localhost)
    # refuses to start: anyone who reaches the port could drive the robot. true: start anyway, with a warning.
    allow_unauthenticated: bool = False
    # Real-time chunking (a request with prev_actions / delay; slurmvla/policy/rtc.py): the largest guidance
    # weight (the paper's beta), and the guidance weights over the overlap after the delay: zeros (the default: a
    # hard mask, only the d actions that run during the delay guide; a request with d = 0 is a plain one), exp
    # (the paper's soft mask), linear, ones (the whole overlap as the frozen part). The soft mask pulls the actions
    # the robot will run from the new chunk towards the older plan and costs success at d = 1-2 on the pick task
    # (docs/serving.md, "Which real-time chunking").
    rtc_max_guidance: float = 5.0
    rtc_schedule: str = "zeros"
    # The guidance's Jacobian: identity (LeRobot 0.6.1's form: the weighted error itself, no backward pass; the
    # default) or model (the paper's vector-Jacobian product through the velocity, which spreads 63-80 % of each
    # dim's pull over the others on the pick task).
    rtc_jacobian: str = "identity"
    # The action dims guided towards the previous chunk; null: every one. The others follow the policy alone;
    # the delay's actions are the previous chunk's in every dim. Each embodiment's experiment leaves its gripper
    # unguided (DROID's dim 7: [0,1,2,3,4,5,6]; Meta-World's dim 3: [0,1,2]).
    rtc_guided_dims: list[int] | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.request_interval, int) and self.request_interval >= 1):
            raise ValueError(f"serve.request_interval={self.request_interval!r} must be a whole number of control "
                             "steps >= 1 (1: each request is the next frame)")
        if not 0 <= self.rtc_max_guidance < float("inf"):
            raise ValueError(f"serve.rtc_max_guidance={self.rtc_max_guidance} must be a number >= 0 (the paper's "
                             "5.0; 0 turns guidance off, the delay's actions still come from prev_actions)")
        if self.weights not in SERVED_WEIGHTS:
            raise ValueError(f"serve.weights={self.weights!r} is not one of {', '.join(SERVED_WEIGHTS)}")
        if self.rtc_schedule not in RTC_SCHEDULES:
            raise ValueError(f"serve.rtc_schedule={self.rtc_schedule!r} is not one of {', '.join(RTC_SCHEDULES)}")
        if self.rtc_jacobian not in RTC_JACOBIANS:
            raise ValueError(f"serve.rtc_jacobian={self.rtc_jacobian!r} is not one of {', '.join(RTC_JACOBIANS)}")
        if self.rtc_guided_dims is not None and (not self.rtc_guided_dims or min(self.rtc_guided_dims) < 0
                                                 or len(set(self.rtc_guided_dims)) != len(self.rtc_guided_dims)):
            raise ValueError(f"serve.rtc_guided_dims={list(self.rtc_guided_dims)} must be distinct action dims >= 0 "
                             "(null: every dim)")
        if not 0 <= self.port < 65536:
            raise ValueError(f"serve.port={self.port} is not a TCP port (0..65535; 0 picks a free one)")
        if self.max_request_mb is not None and not (0 < self.max_request_mb < float("inf")):
            raise ValueError(f"serve.max_request_mb={self.max_request_mb} is not a size: give a number of MiB > 0 "
                             "(e.g. 64), or null for the default derived from the policy's observation size")
        for name in ("max_connections", "max_pending"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"serve.{name}={value!r} is not valid: give an integer >= 1 (default "
                                 f"{getattr(ServeConfig, name)})")
        if self.api_key_env is not None and not (self.api_key_env.isascii() and self.api_key_env.replace("_", "a").isalnum()
                                               and not self.api_key_env[0].isdigit()):
            # Not echoed: a key put here by mistake must not reach the terminal or a log.
            raise ValueError("serve.api_key_env must be the NAME of an environment variable holding the key "
                             "(letters, digits and _, e.g. SLURMVLA_API_KEY), not the key itself")
        if self.api_key_file is not None and not self.api_key_file.strip():
            raise ValueError("serve.api_key_file is empty; give the path of a file holding the key, or null")
        if not self.state:
            raise ValueError("serve.state is empty; name the client keys that make up the state, e.g. "
                             "[observation/joint_position, observation/gripper_position]")
        if not any(self.cameras):
            raise ValueError(f"serve.cameras={self.cameras} names no client key; a policy needs at least one camera")
