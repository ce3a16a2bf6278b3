"""Storage: the on-disk format (format.py), the shard store, the chunk writer and reader, fp8 quantization."""
