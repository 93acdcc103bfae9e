"""Tessera's lab: the simulator, the chaos harnesses, many hosts on one machine and the answer-F1 eval.

Nothing here serves a request. It builds on the serving package ``tessera`` (the real control
plane, launcher, bench client and workloads) and ``tessera`` never imports it: the ``tessera``
commands that run lab code (``simulate``, ``chaos``, ``hosts``, ``eval``) import it inside the
command's body.
"""
