"""Composition of cached units into a prompt: the swappable policies and the pure layout math
(ranges, placements, tokens to compute). Nothing here touches tensors.
"""
