"""Weight-only quantized stages: the weight and its kernels (linear), LoRA (lora), probe, quantizer, report."""
