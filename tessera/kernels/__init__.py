"""Device kernels, each beside a typed wrapper and the torch reference the tests compare against."""
