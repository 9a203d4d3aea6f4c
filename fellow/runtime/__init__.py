"""The torch side of a fellow: loading, stage runtime, KV cache, batching, sampling."""
