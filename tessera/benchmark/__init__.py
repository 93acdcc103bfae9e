"""Workloads, the open-loop load client, ``tessera bench`` / ``demo`` / ``report`` / ``analyze`` /
``trace`` / ``verify``, and report printing.
"""
