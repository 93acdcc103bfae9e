"""Engine adapters (the contract, a registry, the PyTorch reference engine), the model and its
weights, RoPE, tokenizer, sampling, and the offline composition oracle.
"""
