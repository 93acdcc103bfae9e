"""Which control plane a retrieval replica uses: its own while it leads, the leader's otherwise.

* :mod:`.office`: holds (or refuses) the plane for the current term and hands out the path to it;
* :mod:`.path`: the verbs the chat driver calls, on the local plane or over the leader's RPCs;
* :mod:`.liveness`: the leader's heartbeats as a replica that does not lead sees them.

Without ``[ha]`` there is one replica and it always holds its own plane.
"""
