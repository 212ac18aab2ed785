"""slurmvla's Meta-World study as a plug-in: policies tied to one benchmark and its calibrated camera, kept out of
the product package. Each sub-folder with a ``config.py`` is a policy folder (``ENTRIES``, as in
``slurmvla/policy/``), found through the ``slurmvla.policies`` entry point this distribution declares:

- ``hand_crop``: ``policy=keypoints_flow_crop`` (``keypoints_crop``: the regression head), a second view of each
  frame cut around the fingertips through Meta-World's camera calibration;
- ``labelled_keypoints``: ``policy=keypoints_flow_labelled``, whose image keypoints train onto the objects' pixels.
- ``auxiliary``: ``policy=keypoints_flow_aux`` and ``keypoints_flow_pixel_aux``, the study's auxiliary targets and oracle
  diagnostics (for which the labelled policy has its ``scaled_extra`` / ``extra`` hooks), and the command that
  measures where their keypoints are: ``python -m slurmvla_metaworld_study.auxiliary``.

Importing it imports no torch (slurmvla reads the folders' ``config`` modules to validate a config)."""
