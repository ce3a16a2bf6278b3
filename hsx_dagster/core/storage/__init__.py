"""Storage: the on-disk format (format.py), what a shard is (provenance.py), the shard store, the chunk writer and
reader, fp8 quantization, and the file primitives every store shares (atomic.py: crash-safe writes; files.py:
locks, streaming hashes, folder swaps)."""
