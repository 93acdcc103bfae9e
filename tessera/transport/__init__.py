"""Moving unit states between generation nodes and memory nodes' block arenas.

``base`` (the Transport contract and registry), ``blocks`` (slot layout, headers, checksums),
``arena`` (POSIX shm segment), ``shm`` / ``tcp`` / ``mooncake`` (transports), ``pool`` (the
generation node's fetch/store client).
"""
