"""Plain helpers of the tests: values, builders and small clients, none with a teardown.

Anything a test must start and stop (clusters, role processes, memory nodes, checkpoints, the
cluster secret, executors) is a fixture in ``tests/fixtures/`` instead; fixtures build on these.

- ``cluster``: free ports, the one cluster config builder, config files, signed internal GETs;
- ``http``: calling a running cluster (``call``, ``chat``, ``node_metric``, ``wait_for``);
- ``processes``: the types of role processes the fixtures start (``RoleProcess``, ``MemoryNodeProcess``);
- ``clock``: the one fake clock;
- ``plane``: an in-process control plane with generation nodes that follow its plans;
- ``kvpool``: the tiny KV geometry, random unit states, memory-node cluster configs;
- ``engines``: tiny engines on random checkpoints, random layouts, the fake engine;
- ``executor``: an executor's request builders and fake collaborators;
- ``mixed``: the served scenario mixing a local hit, a remote hit and a miss.
"""
