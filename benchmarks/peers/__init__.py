"""fuyou against DeepSpeed and Colossal-AI on the same model and data (``python -m benchmarks.peers``)."""
