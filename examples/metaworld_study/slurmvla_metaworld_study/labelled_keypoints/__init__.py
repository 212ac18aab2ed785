"""Meta-World's fingertip-crop flow policy whose image keypoints train onto the objects' pixels
(``policy=keypoints_flow_labelled``): ``config`` (its options and registry entry; no torch) and ``model``."""
