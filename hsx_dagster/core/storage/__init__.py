"""Storage: the on-disk format (format.py), what a shard is (provenance.py), the shard store, the chunk writer and
reader, fp8 quantization, and the file primitives every store shares (atomic.py: crash-safe writes; files.py:
locks, streaming hashes, folder swaps)."""

from typing import TYPE_CHECKING

from hsx_dagster.core.public_api import lazy_exports

if TYPE_CHECKING:
    from hsx_dagster.core.storage.atomic import (
        StoreError as StoreError,
        append_lines as append_lines,
        drop_torn_tail as drop_torn_tail,
        read_lines as read_lines,
        write_atomic as write_atomic,
    )
    from hsx_dagster.core.storage.chunk_checks import (
        MAX_LISTED as MAX_LISTED,
        LayerStatistics as LayerStatistics,
        TokenizedRows as TokenizedRows,
        chunk_problems as chunk_problems,
        positions_of as positions_of,
        scanned_chunk_problems as scanned_chunk_problems,
    )
    from hsx_dagster.core.storage.chunk_file import (
        ChunkTensor as ChunkTensor,
        chunk_header as chunk_header,
        write_chunk as write_chunk,
    )
    from hsx_dagster.core.storage.chunk_reader import (
        iter_shard_samples as iter_shard_samples,
        read_sample as read_sample,
    )
    from hsx_dagster.core.storage.chunk_scan import (
        SMALL_TENSORS as SMALL_TENSORS,
        ScannedChunk as ScannedChunk,
        read_verified_chunk as read_verified_chunk,
        scan_chunk as scan_chunk,
    )
    from hsx_dagster.core.storage.chunk_stats import token_statistics as token_statistics
    from hsx_dagster.core.storage.chunk_writer import (
        MIN_HOST_BYTES as MIN_HOST_BYTES,
        ChunkWriter as ChunkWriter,
        NonFiniteStatesError as NonFiniteStatesError,
        StagedBatch as StagedBatch,
        statistics_specs as statistics_specs,
    )
    from hsx_dagster.core.storage.cpu_account import (
        PART_MEANING as PART_MEANING,
        PARTS as PARTS,
        CpuAccount as CpuAccount,
    )
    from hsx_dagster.core.storage.direct_io import choose_direct as choose_direct, filesystem_type as filesystem_type
    from hsx_dagster.core.storage.files import (
        FileLock as FileLock,
        LockRefusedError as LockRefusedError,
        atomic_output as atomic_output,
        file_sha256 as file_sha256,
        folder_bytes as folder_bytes,
        fsync_path as fsync_path,
        remove_leftovers as remove_leftovers,
        staging_dir_for as staging_dir_for,
        swap_in_dir as swap_in_dir,
    )
    from hsx_dagster.core.storage.format import (
        COMPLETE_FILE as COMPLETE_FILE,
        COMPUTE_DTYPES as COMPUTE_DTYPES,
        DRAFTER_FORMAT as DRAFTER_FORMAT,
        DRAFTER_INDEX_FILE as DRAFTER_INDEX_FILE,
        DRAFTER_INDEX_SCHEMA as DRAFTER_INDEX_SCHEMA,
        DRAFTER_QUARANTINE_FILE as DRAFTER_QUARANTINE_FILE,
        DRAFTER_QUARANTINE_SCHEMA as DRAFTER_QUARANTINE_SCHEMA,
        DRAFTER_VERSION as DRAFTER_VERSION,
        FP8_DTYPE as FP8_DTYPE,
        HIDDEN_STATES_VERSION as HIDDEN_STATES_VERSION,
        LOCK_FILE as LOCK_FILE,
        MANIFEST_FILE as MANIFEST_FILE,
        REJECT_SCHEMA as REJECT_SCHEMA,
        SAMPLE_SCHEMA as SAMPLE_SCHEMA,
        SCALES_SUFFIX as SCALES_SUFFIX,
        SET_ASIDE_DIR as SET_ASIDE_DIR,
        SHARD_FILE as SHARD_FILE,
        SHARD_INDEX_FILE as SHARD_INDEX_FILE,
        SPLIT_BATCHES_FILE as SPLIT_BATCHES_FILE,
        STORAGE_DTYPES as STORAGE_DTYPES,
        TOKENIZED_REJECTS_FILE as TOKENIZED_REJECTS_FILE,
        TOKENIZED_SAMPLES_DIR as TOKENIZED_SAMPLES_DIR,
        TOKENIZED_SUMMARY_FILE as TOKENIZED_SUMMARY_FILE,
        TOKENIZED_VERSION as TOKENIZED_VERSION,
        VERIFIED_FILE as VERIFIED_FILE,
        WRITTEN_FILE as WRITTEN_FILE,
        FormatError as FormatError,
        check_drafter_manifest as check_drafter_manifest,
        dtype_name as dtype_name,
        tokenized_shard_file as tokenized_shard_file,
    )
    from hsx_dagster.core.storage.healing import set_aside_damaged as set_aside_damaged
    from hsx_dagster.core.storage.provenance import (
        FINAL_SLOT as FINAL_SLOT,
        MEANING as MEANING,
        ChunkLayout as ChunkLayout,
        ShardProvenance as ShardProvenance,
        StoredLayers as StoredLayers,
    )
    from hsx_dagster.core.storage.quantization import (
        FP8_MAX as FP8_MAX,
        block_size_for as block_size_for,
        bytes_per_vector as bytes_per_vector,
        dequantize as dequantize,
        quantize as quantize,
        scale_layout as scale_layout,
    )
    from hsx_dagster.core.storage.shard_membership import (
        chunks_with_changed_tokens as chunks_with_changed_tokens,
        shard_work as shard_work,
    )
    from hsx_dagster.core.storage.shard_records import (
        ChunkRecord as ChunkRecord,
        ShardTotals as ShardTotals,
        read_index as read_index,
        read_quarantine as read_quarantine,
        read_verified as read_verified,
        read_written as read_written,
        record_verified as record_verified,
        shard_totals as shard_totals,
        verified_unchanged as verified_unchanged,
        written_unchanged as written_unchanged,
    )
    from hsx_dagster.core.storage.shard_store import ShardStore as ShardStore
    from hsx_dagster.core.storage.staging import RowSpec as RowSpec, Span as Span, StagingRing as StagingRing

EXPORTS = {
    "atomic": ["StoreError", "append_lines", "drop_torn_tail", "read_lines", "write_atomic"],
    "chunk_checks": [
        "LayerStatistics",
        "MAX_LISTED",
        "TokenizedRows",
        "chunk_problems",
        "positions_of",
        "scanned_chunk_problems",
    ],
    "chunk_file": ["ChunkTensor", "chunk_header", "write_chunk"],
    "chunk_reader": ["iter_shard_samples", "read_sample"],
    "chunk_scan": ["SMALL_TENSORS", "ScannedChunk", "read_verified_chunk", "scan_chunk"],
    "chunk_stats": ["token_statistics"],
    "chunk_writer": ["ChunkWriter", "MIN_HOST_BYTES", "NonFiniteStatesError", "StagedBatch", "statistics_specs"],
    "files": [
        "FileLock",
        "LockRefusedError",
        "atomic_output",
        "file_sha256",
        "folder_bytes",
        "fsync_path",
        "remove_leftovers",
        "staging_dir_for",
        "swap_in_dir",
    ],
    "format": [
        "COMPLETE_FILE",
        "COMPUTE_DTYPES",
        "DRAFTER_FORMAT",
        "DRAFTER_INDEX_FILE",
        "DRAFTER_INDEX_SCHEMA",
        "DRAFTER_QUARANTINE_FILE",
        "DRAFTER_QUARANTINE_SCHEMA",
        "DRAFTER_VERSION",
        "FP8_DTYPE",
        "FormatError",
        "HIDDEN_STATES_VERSION",
        "LOCK_FILE",
        "MANIFEST_FILE",
        "REJECT_SCHEMA",
        "SAMPLE_SCHEMA",
        "SCALES_SUFFIX",
        "SET_ASIDE_DIR",
        "SHARD_FILE",
        "SHARD_INDEX_FILE",
        "SPLIT_BATCHES_FILE",
        "STORAGE_DTYPES",
        "TOKENIZED_REJECTS_FILE",
        "TOKENIZED_SAMPLES_DIR",
        "TOKENIZED_SUMMARY_FILE",
        "TOKENIZED_VERSION",
        "VERIFIED_FILE",
        "WRITTEN_FILE",
        "check_drafter_manifest",
        "dtype_name",
        "tokenized_shard_file",
    ],
    "cpu_account": ["CpuAccount", "PARTS", "PART_MEANING"],
    "direct_io": ["choose_direct", "filesystem_type"],
    "healing": ["set_aside_damaged"],
    "provenance": ["ChunkLayout", "FINAL_SLOT", "MEANING", "ShardProvenance", "StoredLayers"],
    "quantization": ["FP8_MAX", "block_size_for", "bytes_per_vector", "dequantize", "quantize", "scale_layout"],
    "shard_membership": ["chunks_with_changed_tokens", "shard_work"],
    "shard_records": [
        "ChunkRecord",
        "ShardTotals",
        "read_index",
        "read_quarantine",
        "read_verified",
        "read_written",
        "record_verified",
        "shard_totals",
        "verified_unchanged",
        "written_unchanged",
    ],
    "shard_store": ["ShardStore"],
    "staging": ["RowSpec", "Span", "StagingRing"],
}
if not TYPE_CHECKING:  # for mypy, the imports above are the package's names
    __all__, __getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
