"""Typed messages between roles (paper §5.1, Fig. 10), one module per boundary.

* :mod:`~tessera.messages.common`: the version check, block references, the plain answer.
* :mod:`~tessera.messages.prompt`: the prompt layout (text and unit segments).
* :mod:`~tessera.messages.plan`: the control plane's plan, with its read leases and write grants.
* :mod:`~tessera.messages.control`: requests the control plane answers (route, plan, publish, ...).
* :mod:`~tessera.messages.kvpool`: memory node <-> control plane (hello, inventory).
* :mod:`~tessera.messages.generation`: retrieval role -> generation node, and the execute stream.

One frozen dataclass per message, encoded with :mod:`tessera.wire`; the same types serve the
HTTP API, the tests and the bench. Import each name from its module: this package re-exports
nothing, so a name has one home.
"""
