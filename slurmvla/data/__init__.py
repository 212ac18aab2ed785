"""Data layer: LeRobot-format readers, the DROID dataset, the sample-data writer. Imports only the layers below it
(the configuration and the foundation; docs/architecture.md)."""
