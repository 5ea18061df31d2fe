"""The layout search over the physics: enumeration, pruning, the memory levers."""
