"""The retrieval role: unit store, ANN index, embedder, its HTTP routes, the OpenAI-compatible
chat API, prompt rendering and the client toward generation nodes.

* :mod:`.store`: the unit records, the ANN index and the embedder's pool of units;
* :mod:`.chat`: the chat API, from a client's request through the cluster to its reply;
* :mod:`.leadership`: which control plane this replica uses (its own, or the leader's);
* at this level: the process (``app``, ``node``), the retrieval API (``routes``, ``api``,
  ``openapi``, ``limits``, ``access_log``), the prompt's pure steps (``prompt``, ``prompt_path``),
  the embedder, the index follower and the revocation broadcast.
"""
