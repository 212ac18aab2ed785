"""Feature names of LeRobot's DROID 1.0.1 port: the defaults of ``data.*`` and what the sample writer writes.

Constants only (no imports), so the config schemas (below the data package) can take their defaults from here.
"""

DROID_CAMERAS = (
    "observation.images.exterior_1_left",
    "observation.images.exterior_2_left",
    "observation.images.wrist_left",
)
DROID_INSTRUCTION_KEYS = ("language_instruction", "language_instruction_2", "language_instruction_3")
# The keys openpi's DROID client sends the same three cameras under (in DROID_CAMERAS' order); its default
# client sends the first and the last (serve.cameras).
DROID_CLIENT_CAMERAS = (
    "observation/exterior_image_1_left",
    "observation/exterior_image_2_left",
    "observation/wrist_image_left",
)
