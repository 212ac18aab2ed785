"""Inference: everything the programs that run a trained policy share (serve, evaluate, rollout, export,
the trainer's closed loop through ``train``, the benchmarks), one job per module.

- :mod:`~slurmvla.inference.load`: a trained policy rebuilt from its config and weights (an exported file, a
  checkpoint folder, a run directory); :mod:`~slurmvla.inference.lerobot_checkpoint`: a LeRobot pi0 / pi0.5 directory.
- :mod:`~slurmvla.inference.optimize` and :mod:`~slurmvla.inference.graphs`: the serving-only weight work
  (one dtype, fused projections, compiled layers, CUDA graphs).
- :mod:`~slurmvla.inference.runner`: observations -> the policy's batch -> an action chunk.
- :mod:`~slurmvla.inference.wire`, :mod:`~slurmvla.inference.auth`, :mod:`~slurmvla.inference.server`,
  :mod:`~slurmvla.inference.harness`: openpi's websocket protocol in front of anything with ``infer(obs)``.
- :mod:`~slurmvla.inference.build`: a source and overrides -> a runner, a server.
- :mod:`~slurmvla.inference.executor`: the robot side: which action of which chunk runs at each control tick
  (sync, async, rtc); numpy only, so it runs on a robot without torch.
- :mod:`~slurmvla.inference.closed_loop`: episodes of the simulated task through openpi's client.

Beside the trainer (layer 5): neither imports the other; ``train`` hands the closed loop to the trainer.
"""
