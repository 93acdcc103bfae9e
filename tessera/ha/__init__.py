"""High availability of the retrieval role: election, leader discovery, replicas, local servers.

``election`` (etcd's Election recipe: lease, campaign, observe, resign), ``campaign`` (a
replica's terms, one after another), ``discovery`` (follow the election key), ``etcd_client``
(an etcd client with ``[ha]``'s TLS and user credentials), ``replicas`` (replica *i*'s ports
and folder), ``servers``, ``certificates`` and ``local`` (single-member etcd and PostgreSQL,
behind credentials, for ``tessera up --replicas`` and the tests). The term fence is in
``tessera/transport/terms.py``; which plane a replica uses, in ``tessera/retrieval/leadership/office.py``.

Everything is opt-in (``[ha]`` in the config): the default single-process cluster needs
neither etcd nor PostgreSQL and imports only ``replicas`` (port arithmetic) from here.
"""
