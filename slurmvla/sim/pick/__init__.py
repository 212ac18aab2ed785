"""The DROID-shaped pick task: a 7-joint arm with a parallel gripper lifts a cube (or either of two) from a table,
seen by DROID's three cameras, acting in DROID's joint velocities at 15 Hz. :mod:`.env` (the environment),
:mod:`.expert` (its scripted expert), :mod:`.dataset` (its demonstrations in DROID's layout), :mod:`.config` (its
registry entry)."""
