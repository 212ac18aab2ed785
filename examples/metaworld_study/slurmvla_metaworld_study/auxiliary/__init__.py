"""The study's auxiliary-target policies (``policy=keypoints_flow_aux``, ``policy=keypoints_flow_pixel_aux``):
``config`` (their options and registry entries; no torch) and ``model``, which also measures how well a trained
one's keypoints locate the objects: ``python -m slurmvla_metaworld_study.auxiliary RUN DATA_ROOT`` (or ``RUN --pixels
FIRST_SEED END_SEED``)."""
