"""slurmvla: a SLURM-native launcher and training toolkit for Vision-Language-Action policies."""

__version__ = "0.1.0"
