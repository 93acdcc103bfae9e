"""High availability of the retrieval role: leader election, term fencing, replicated unit store.

Everything here is opt-in (``[ha]`` in the config); the default single-process cluster imports
none of it and needs neither etcd nor PostgreSQL.
"""
