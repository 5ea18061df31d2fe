"""The planner against measurements: published rows, fits, leave-one-out, intervals, the exact check."""
