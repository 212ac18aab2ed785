"""Data layer: LeRobot-format readers, the DROID dataset, the sample-data writer. Imports no other layer
except ``slurmvla.config``."""
