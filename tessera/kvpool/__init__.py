"""The shared KV pool's memory node: a block arena in POSIX shm served to generation nodes.
"""
