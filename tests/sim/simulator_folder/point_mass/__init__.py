"""A point mass pushed towards a goal on a plane, seen from above: a simulator in a few lines of NumPy."""
