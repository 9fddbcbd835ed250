"""Session affinity across router replicas: "sticky until saturated", with its calibrated limit."""
