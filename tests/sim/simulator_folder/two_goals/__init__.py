"""A point mass between two goals, the instruction naming the one to reach: one scene, two tasks told apart only in words."""
