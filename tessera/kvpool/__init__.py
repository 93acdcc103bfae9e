"""The shared KV Pool: memory nodes (arena + data server) and the control-plane client."""
