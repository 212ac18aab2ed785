"""The keypoint policies (``policy=keypoints``, ``policy=keypoints_flow``), one folder: ``config`` (their options and
registry entries; no torch) and ``model`` (the classes, with torch)."""
