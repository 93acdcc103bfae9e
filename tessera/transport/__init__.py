"""Moving unit states between generation nodes and memory nodes' block arenas: the Transport
contract and registry, the arena, block format and headers, frames, limits, and the ``shm``,
``tcp`` and ``mooncake`` transports.
"""
