"""The OpenAI-compatible chat API: from a client's request to its reply, through the cluster.

* :mod:`.routes`: the handler (admission, parsing, error replies) and the API's other routes;
* :mod:`.request` / :mod:`.response`: the request schema and validator, the reply bodies;
* :mod:`.layout`: the request's units and its fixed prompt layout;
* :mod:`.driver`: one request through the cluster (route, snapshot, plan, execute, complete),
  over :mod:`.generation_client`, the client of the generation nodes;
* :mod:`.reply`: node events become the reply, with its usage, :mod:`.receipt` and :mod:`.metrics`;
* :mod:`.serving`: the per-process state they share.

The chat path knows which control plane to ask only through the retrieval node's office
(:mod:`tessera.retrieval.leadership`); the prompt's pure steps are :mod:`tessera.retrieval.prompt_path`'s.
"""
