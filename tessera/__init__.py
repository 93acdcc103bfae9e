"""Tessera: retrieval as the control plane for KV-cache reuse in RAG and agent-memory serving."""

__version__ = "0.1.0"
