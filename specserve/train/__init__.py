"""Training drafters for specserve's speculative decoding (EAGLE-3 first), in plain PyTorch on CPU."""
