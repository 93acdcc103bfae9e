"""``tessera chaos``: faults under load as real processes, on one host or with replicated retrieval."""
