"""Why inference-time RTC's guidance through the model's Jacobian does what it does, per action dim.

    python benchmarks/rtc_jacobian.py RUN_DIR [--episodes 10] [--delay 0] [--first-seed 300000] [overrides ...]

``RUN_DIR``: a trained flow policy of the simulated pick task (as for ``benchmarks/rtc.py``). The closed loop runs
in the ``rtc`` execution mode with ``serve.rtc_jacobian=model`` (the paper's form, the error pulled back through
the velocity by a vector-Jacobian product) on seeds no demonstration or evaluation table used. On every guided
flow step of every request it records, per action dim j (over the guided positions of the overlap):

- ``error``: the weighted error ``|w (Y - x_hat)|`` the guidance starts from (what the identity form applies);
- ``pull``: that error pulled back through ``d x_hat / d x_t`` (what the model form applies); ``gain`` = pull /
  error (1 for the identity form);
- ``jac``: the Jacobian's rows of dim j, ``|d x_hat[:, j] / d x_t|`` (Frobenius, per overlap position), from one
  vector-Jacobian product per row on the first ``--jacobian-requests`` requests of each episode;
- ``out`` / ``in``: of what dim j's error alone moves (its pull back), the share landing on other dims; of what
  moves dim j, the share coming from other dims' errors (the Jacobian's off-diagonal blocks).

And per request, for the chunk's executed positions: each dim's guided action against the same noise integrated
without guidance and against the previous chunk (the target), in the dataset's units: the gripper's guided values.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slurmvla.inference.build import build_server  # noqa: E402
from slurmvla.inference.closed_loop import replan_of, require_sim, run_served, summarize  # noqa: E402
from slurmvla.policy import rtc  # noqa: E402


class Recorder:
    def __init__(self, jacobian_requests: int):
        self.steps: list[dict] = []
        self.chunks: list[dict] = []
        self.requests = 0
        self.jacobian_requests = jacobian_requests
        self.in_episode = 0

    def velocity(self, guide: rtc.Guide, velocity, x: torch.Tensor, t: float) -> torch.Tensor:
        with torch.enable_grad():
            x_in = x.detach().float().requires_grad_(True)
            u = velocity(x_in).float()
            clean = x_in - t * u
            error = (guide.target - clean.detach()) * guide.weights
            (pull,) = torch.autograd.grad(clean, x_in, grad_outputs=error, retain_graph=True)
            guided = guide.weights > 0  # [B, H, D]
            row = {"t": t, "error": (error * guided).abs().sum(dim=(0, 1)), "pull": (pull * guided).abs().sum(dim=(0, 1))}
            # The pull back from each dim's error alone: how much of it lands on the other dims.
            dims = error.shape[-1]
            # moved[j, k]: how far dim j's error alone moves dim k (the pull back of the error of dim j only).
            moved = torch.zeros(dims, dims)
            for j in range(dims):
                e = torch.zeros_like(error)
                e[..., j] = error[..., j]
                if e.abs().sum() == 0:
                    continue
                (p,) = torch.autograd.grad(clean, x_in, grad_outputs=e, retain_graph=True)
                moved[j] = p.abs().sum(dim=(0, 1))
            row["moved"] = moved
            if self.in_episode < self.jacobian_requests:
                positions = guided.any(dim=(0, 2)).nonzero().flatten().tolist()
                jac = torch.zeros(dims)
                for j in range(dims):
                    for i in positions:
                        e = torch.zeros_like(error)
                        e[:, i, j] = 1.0
                        (p,) = torch.autograd.grad(clean, x_in, grad_outputs=e, retain_graph=True)
                        jac[j] += p.pow(2).sum()
                row["jac"] = (jac / max(len(positions), 1)).sqrt()
            self.steps.append(row)
        return u.detach() - rtc.guidance_weight(t, guide.max_guidance) * pull.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source")
    parser.add_argument("--episodes", type=int, default=10)
    parser.add_argument("--delay", type=int, default=0)
    parser.add_argument("--first-seed", type=int, default=300_000)
    parser.add_argument("--jacobian-requests", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    require_sim()
    server = build_server(args.source, ["serve.rtc_guided_dims=null", *args.overrides, "serve.rtc_jacobian=model", "serve.host=127.0.0.1",
                                        "serve.port=0"], environ={})
    rec = Recorder(args.jacobian_requests)
    plain_integrate = rtc.integrate

    def recording_velocity(guide, velocity, x, t):
        return rec.velocity(guide, velocity, x, t)

    def integrate(velocity, x, steps, guide=None):
        out = plain_integrate(velocity, x, steps, guide)
        if isinstance(guide, rtc.Guide):
            with torch.no_grad():
                unguided = plain_integrate(velocity, x, steps, None)
            rec.chunks.append({"guided": out.detach(), "unguided": unguided, "target": guide.target,
                               "weights": guide.weights, "delay": guide.delay})
            rec.requests += 1
            rec.in_episode += 1
        return out

    rtc.Guide.velocity = recording_velocity
    import slurmvla.policy.keypoints.model as keypoint_model

    keypoint_model.integrate = integrate
    base = server.policy.loaded.cfg.rollout
    cfg = dataclasses.replace(base, execution="rtc", delay_steps=args.delay, delay="fixed", videos=0,
                              episodes=args.episodes, first_seed=args.first_seed)
    seeds = list(range(args.first_seed, args.first_seed + args.episodes))
    start = time.perf_counter()
    episodes = []
    for seed in seeds:
        rec.in_episode = 0
        episodes += run_served(server, cfg, [seed], None)
    s = summarize(episodes, time.perf_counter() - start)
    print(f"{args.source}: rtc, d = {args.delay}, model Jacobian, beta {server.policy.loaded.cfg.serve.rtc_max_guidance}; "
          f"{s['rollout/successes']}/{s['rollout/episodes']} successes, {rec.requests} guided requests, "
          f"{len(rec.steps)} guided flow steps")
    dims = rec.steps[0]["error"].shape[0]
    error = torch.stack([r["error"] for r in rec.steps]).sum(0)
    pull = torch.stack([r["pull"] for r in rec.steps]).sum(0)
    moved = torch.stack([r["moved"] for r in rec.steps]).sum(0)
    off = moved * (1 - torch.eye(dims))
    out_share = off.sum(1) / moved.sum(1).clamp_min(1e-12)  # of what dim j's error moves, the share on other dims
    in_share = off.sum(0) / moved.sum(0).clamp_min(1e-12)  # of what moves dim k, the share from other dims' errors
    jac = [r["jac"] for r in rec.steps if "jac" in r]
    jac = torch.stack(jac).mean(0) if jac else torch.full((dims,), float("nan"))
    print(f"{'dim':>4} {'error sum':>10} {'pull sum':>10} {'gain':>6} {'out':>6} {'in':>6} {'|J rows|':>9}  (normalized "
          "units; out: share of what the dim's error moves that lands on other dims; in: share of what moves the dim "
          "that comes from other dims' errors)")
    for j in range(dims):
        print(f"{j:4d} {float(error[j]):10.3f} {float(pull[j]):10.3f} {float(pull[j] / error[j].clamp_min(1e-12)):6.2f} "
              f"{float(out_share[j]):6.2f} {float(in_share[j]):6.2f} {float(jac[j]):9.3f}")
    # Executed positions (the first replan_steps of each chunk), in the dataset's units: guided against unguided.
    policy = server.policy.loaded.policy
    offset, scale = policy.action_offset.float(), policy.action_scale.float()
    steps = replan_of(dataclasses.replace(base, execution="rtc"), server.policy.metadata()["action_horizon"])
    guided = torch.cat([c["guided"][:, :steps] for c in rec.chunks]) * scale + offset
    unguided = torch.cat([c["unguided"][:, :steps] for c in rec.chunks]) * scale + offset
    print(f"executed actions (the first {steps} of each chunk), dataset units: mean |guided - unguided| per dim")
    print("  " + " ".join(f"{float(v):.3f}" for v in (guided - unguided).abs().mean(dim=(0, 1))))
    g, ug = guided[..., -1].flatten(), unguided[..., -1].flatten()

    def undecided(v: torch.Tensor) -> float:
        return float(((v > 0.2) & (v < 0.8)).float().mean())

    print(f"  gripper (last dim, 0 open .. 1 closed): guided mean {float(g.mean()):.3f}, between 0.2 and 0.8 "
          f"{undecided(g):.3f} of the time; unguided mean {float(ug.mean()):.3f}, between 0.2 and 0.8 {undecided(ug):.3f}")

if __name__ == "__main__":
    main()
