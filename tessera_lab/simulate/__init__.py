"""``tessera simulate``: the real control plane over simulated generation and memory nodes."""
