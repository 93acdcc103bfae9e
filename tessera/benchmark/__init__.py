"""Workloads, the open-loop load client, ``tessera bench`` / ``demo`` / ``eval`` / ``analyze``,
and report printing.
"""
