"""The strategy-selection guide: cells, table, flow, curves."""
