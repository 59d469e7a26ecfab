"""The planner, pure: its input types (`types`: the snapshot of cells, requests, rates), the
decisions (`plan`: how many cells train, which flip, where each moved request goes) and the
gateway's placement of new turns (`placement`)."""
