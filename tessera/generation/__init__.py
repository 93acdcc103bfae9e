"""The generation role: node, executor, scheduler, coalesced unit prefills, retention, the local
unit cache and the KV-pool client.
"""
