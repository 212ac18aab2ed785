"""Write tests/golden/old_release/: a tiny run checkpointed by an earlier release of slurmvla, with that release's own
code, for tests/test_formats.py (a user's run and exported policy keep working after an upgrade).

    python tests/reference/make_old_release.py              # the release at OLD_COMMIT
    python tests/reference/make_old_release.py --commit REV

The commit is written out of this repository (``git archive``) into a temporary directory and run there, with
``PYTHONPATH`` pointing at it and ``slurmvla/conf`` linked to its ``conf/`` (an editable install maps
``slurmvla.conf`` to the checkout's own ``conf/``, which a copy of the tree does not have). On the sample data
(6 episodes, seed 1: the writer gives the same bytes in both releases), on the CPU, one thread, that release's
keypoint policy cut down (``policy=keypoints``: ``policy.name: custom``, ``policy.target:
slurmvla.sim.policies.KeypointPolicy`` before the policy move) trains:

- ``run/``: to step N = 3 of 2N = 6 and stops (``fit(stop_at=3)``): its ``config.resolved.yaml``, ``metrics.jsonl``
  and ``checkpoints/step_00000003/``, as that release wrote them (``environment.json`` left out: the machine's
  host name and environment);
- ``uninterrupted_step_00000006.safetensors``: the weights of the same run trained to step 6 without a stop;
- ``policy.safetensors``: that run exported by that release (``python -m slurmvla.export``);
- ``request.msgpack``: one observation as a DROID client sends it (openpi's msgpack frame), and in
  ``old_release.json`` the chunk that release's own server answered to it, beside the commit, the versions and the
  CPU that wrote it.

About 0.9 MB in all. The files are that release's: regenerate them only to move the fixture to another release.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "tests" / "golden" / "old_release"
# The last commit before the policy move (slurmvla.sim.policies -> slurmvla.policy.keypoints / baselines, the
# Meta-World study's policies into its plug-in) and the versioned formats.
OLD_COMMIT = "3059457"
CHECKPOINTED, STEPS = 3, 6
DATA = {"num_episodes": 6, "seed": 1, "episodes_per_file": 3}
OVERRIDES = [
    "trainer.device=cpu", "data.num_workers=0", "logging.wandb.mode=disabled", "trainer.progress_bar=false",
    "trainer.global_batch_size=4", f"trainer.max_steps={STEPS}", f"checkpoint.every_steps={CHECKPOINTED}",
    "trainer.log_every_steps=1", "trainer.val_every_steps=0", "optim.lr=1e-3", "scheduler.warmup_steps=2",
    # policy=keypoints, small: 4 keypoints per camera, a 16-wide head, 32 px images.
    "policy=keypoints", "policy.image_size=32", "+policy.kwargs.hidden=16", "+policy.kwargs.keypoints=4",
]


def inside(work: Path) -> None:
    """Run by the old release's interpreter (``PYTHONPATH`` = its tree): train, export, serve, ask once."""
    import numpy as np
    import torch
    from websockets.sync.client import connect

    import slurmvla
    from slurmvla import conf

    tree = Path(os.environ["PYTHONPATH"]).resolve()
    for where in (Path(slurmvla.__file__), Path(list(conf.__path__)[0])):
        assert tree in where.resolve().parents, f"{where} is not the old release's ({tree})"
    torch.set_num_threads(1)
    from slurmvla.compose import compose
    from slurmvla.data.synthetic import write_droid_sample
    from slurmvla.export import export
    from slurmvla.inference.build import build_server
    from slurmvla.inference.harness import serving_in_thread
    from slurmvla.inference.wire import packb, unpackb
    from slurmvla.trainer import Trainer

    data = write_droid_sample(work / "data", **DATA)
    cfg = compose([f"data.root={data}", *OVERRIDES])
    for name, stop_at in (("run", CHECKPOINTED), ("uninterrupted", None)):
        trainer = Trainer(cfg, work / name)
        trainer.fit(stop_at=stop_at)
        trainer.close()
    export(work / "uninterrupted", work / "policy.safetensors")

    g = np.random.default_rng(0)
    request = packb({
        "observation/exterior_image_1_left": g.integers(0, 256, (48, 64, 3), dtype=np.uint8),
        "observation/wrist_image_left": g.integers(0, 256, (48, 64, 3), dtype=np.uint8),
        "observation/joint_position": g.normal(size=7), "observation/gripper_position": g.uniform(size=1),
        "prompt": "pick up the cup",
    })
    (work / "request.msgpack").write_bytes(request)
    server = build_server(str(work / "policy.safetensors"), ["serve.host=127.0.0.1", "serve.port=0"], device="cpu",
                          environ={})
    with serving_in_thread(server) as port, connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None) as ws:
        ws.recv()  # the server's metadata
        ws.send(request)
        reply = unpackb(ws.recv())
    (work / "answer.json").write_text(json.dumps({
        "actions": np.asarray(reply["actions"], dtype=np.float32).tolist(),
        "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", default=OLD_COMMIT)
    parser.add_argument("--inside", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        return inside(args.inside)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", args.commit], capture_output=True, text=True,
                            check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="slurmvla-old-release-") as tmp:
        tree, work = Path(tmp) / "tree", Path(tmp) / "work"
        tree.mkdir(), work.mkdir()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        (tree / "slurmvla" / "conf").symlink_to("../conf")
        env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--inside", str(work)], cwd=tree, env=env,
                       check=True)
        shutil.rmtree(OUT, ignore_errors=True)
        OUT.mkdir(parents=True)
        shutil.copytree(work / "run", OUT / "run", ignore=shutil.ignore_patterns("environment*.json", ".slurmvla.lock"))
        shutil.copy(work / "uninterrupted" / "checkpoints" / f"step_{STEPS:08d}" / "model.safetensors",
                    OUT / f"uninterrupted_step_{STEPS:08d}.safetensors")
        shutil.copy(work / "policy.safetensors", OUT / "policy.safetensors")
        shutil.copy(work / "request.msgpack", OUT / "request.msgpack")
        answer = json.loads((work / "answer.json").read_text())
    record = {"commit": commit, "made_by": "tests/reference/make_old_release.py", "python": sys.version.split()[0],
              "torch": answer.pop("torch"), "cpu_capability": answer.pop("cpu_capability"),
              "checkpointed_step": CHECKPOINTED, "steps": STEPS, "data": DATA, "overrides": OVERRIDES, **answer}
    (OUT / "old_release.json").write_text(json.dumps(record, indent=1) + "\n")
    size = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"wrote {OUT} ({size / 1e6:.2f} MB) from {commit}")


if __name__ == "__main__":
    main()
