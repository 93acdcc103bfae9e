"""The retrieval role: unit store, ANN index, embedder, its HTTP routes, the OpenAI-compatible
chat API, prompt rendering and the client toward generation nodes.
"""
