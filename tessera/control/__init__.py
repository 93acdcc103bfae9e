"""The control plane (paper §4.2-§4.4): demand, admission, routing, planning, the shared
directory, membership, its ``/control/*`` routes and the client other roles call it with.

It never imports a role package (retrieval, generation, kvpool) and never touches tensors.
"""
