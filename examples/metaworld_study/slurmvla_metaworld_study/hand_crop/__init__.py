"""Meta-World's keypoint policies with a crop at the fingertips (``policy=keypoints_flow_crop``, ``keypoints_crop``):
``config`` (their options and registry entries; no torch) and ``model``."""
