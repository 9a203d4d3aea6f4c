"""The model side: a stage's layers, its KV cache and budget, loading weights, packing, LoRA merge."""
