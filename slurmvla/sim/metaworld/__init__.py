"""Meta-World (metaworld 3.1.1 on MuJoCo 3.3.0) as a simulator of the closed loop, in 3D Diffusion Policy's regime:
:mod:`.env` (a task under the closed loop, its camera's calibration), :mod:`.expert` (the scripted experts),
:mod:`.dataset` (the demonstrations), :mod:`.config` (the registry entry, read without importing Meta-World)."""
