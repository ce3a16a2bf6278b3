"""Storage: the on-disk format (format.py), what a shard is (provenance.py), the shard store, the chunk writer and
reader, fp8 quantization, and the file primitives every store shares (atomic.py: crash-safe writes; files.py:
locks, streaming hashes, folder swaps)."""

from typing import TYPE_CHECKING

from hsx_dagster.core.public_api import lazy_exports

if TYPE_CHECKING:
    from hsx_dagster.core.storage.atomic import (
        StoreError as StoreError,
    )
    from hsx_dagster.core.storage.atomic import (
        append_lines as append_lines,
    )
    from hsx_dagster.core.storage.atomic import (
        drop_torn_tail as drop_torn_tail,
    )
    from hsx_dagster.core.storage.atomic import (
        read_lines as read_lines,
    )
    from hsx_dagster.core.storage.atomic import (
        write_atomic as write_atomic,
    )
    from hsx_dagster.core.storage.chunk_checks import (
        MAX_LISTED as MAX_LISTED,
    )
    from hsx_dagster.core.storage.chunk_checks import (
        LayerStatistics as LayerStatistics,
    )
    from hsx_dagster.core.storage.chunk_checks import (
        TokenizedRows as TokenizedRows,
    )
    from hsx_dagster.core.storage.chunk_checks import (
        chunk_problems as chunk_problems,
    )
    from hsx_dagster.core.storage.chunk_checks import (
        positions_of as positions_of,
    )
    from hsx_dagster.core.storage.chunk_checks import (
        scanned_chunk_problems as scanned_chunk_problems,
    )
    from hsx_dagster.core.storage.chunk_file import (
        ChunkTensor as ChunkTensor,
    )
    from hsx_dagster.core.storage.chunk_file import (
        chunk_header as chunk_header,
    )
    from hsx_dagster.core.storage.chunk_file import (
        write_chunk as write_chunk,
    )
    from hsx_dagster.core.storage.chunk_reader import (
        iter_shard_samples as iter_shard_samples,
    )
    from hsx_dagster.core.storage.chunk_reader import (
        read_sample as read_sample,
    )
    from hsx_dagster.core.storage.chunk_scan import (
        SMALL_TENSORS as SMALL_TENSORS,
    )
    from hsx_dagster.core.storage.chunk_scan import (
        ScannedChunk as ScannedChunk,
    )
    from hsx_dagster.core.storage.chunk_scan import (
        read_verified_chunk as read_verified_chunk,
    )
    from hsx_dagster.core.storage.chunk_scan import (
        scan_chunk as scan_chunk,
    )
    from hsx_dagster.core.storage.chunk_stats import token_statistics as token_statistics
    from hsx_dagster.core.storage.chunk_writer import (
        MIN_HOST_BYTES as MIN_HOST_BYTES,
    )
    from hsx_dagster.core.storage.chunk_writer import (
        ChunkWriter as ChunkWriter,
    )
    from hsx_dagster.core.storage.chunk_writer import (
        NonFiniteStatesError as NonFiniteStatesError,
    )
    from hsx_dagster.core.storage.chunk_writer import (
        StagedBatch as StagedBatch,
    )
    from hsx_dagster.core.storage.chunk_writer import (
        statistics_specs as statistics_specs,
    )
    from hsx_dagster.core.storage.files import (
        FileLock as FileLock,
    )
    from hsx_dagster.core.storage.files import (
        LockRefusedError as LockRefusedError,
    )
    from hsx_dagster.core.storage.files import (
        atomic_output as atomic_output,
    )
    from hsx_dagster.core.storage.files import (
        file_sha256 as file_sha256,
    )
    from hsx_dagster.core.storage.files import (
        folder_bytes as folder_bytes,
    )
    from hsx_dagster.core.storage.files import (
        fsync_path as fsync_path,
    )
    from hsx_dagster.core.storage.files import (
        remove_leftovers as remove_leftovers,
    )
    from hsx_dagster.core.storage.files import (
        staging_dir_for as staging_dir_for,
    )
    from hsx_dagster.core.storage.files import (
        swap_in_dir as swap_in_dir,
    )
    from hsx_dagster.core.storage.format import (
        COMPLETE_FILE as COMPLETE_FILE,
    )
    from hsx_dagster.core.storage.format import (
        COMPUTE_DTYPES as COMPUTE_DTYPES,
    )
    from hsx_dagster.core.storage.format import (
        DRAFTER_FORMAT as DRAFTER_FORMAT,
    )
    from hsx_dagster.core.storage.format import (
        DRAFTER_INDEX_FILE as DRAFTER_INDEX_FILE,
    )
    from hsx_dagster.core.storage.format import (
        DRAFTER_INDEX_SCHEMA as DRAFTER_INDEX_SCHEMA,
    )
    from hsx_dagster.core.storage.format import (
        DRAFTER_QUARANTINE_FILE as DRAFTER_QUARANTINE_FILE,
    )
    from hsx_dagster.core.storage.format import (
        DRAFTER_QUARANTINE_SCHEMA as DRAFTER_QUARANTINE_SCHEMA,
    )
    from hsx_dagster.core.storage.format import (
        DRAFTER_VERSION as DRAFTER_VERSION,
    )
    from hsx_dagster.core.storage.format import (
        FP8_DTYPE as FP8_DTYPE,
    )
    from hsx_dagster.core.storage.format import (
        HIDDEN_STATES_VERSION as HIDDEN_STATES_VERSION,
    )
    from hsx_dagster.core.storage.format import (
        LOCK_FILE as LOCK_FILE,
    )
    from hsx_dagster.core.storage.format import (
        MANIFEST_FILE as MANIFEST_FILE,
    )
    from hsx_dagster.core.storage.format import (
        REJECT_SCHEMA as REJECT_SCHEMA,
    )
    from hsx_dagster.core.storage.format import (
        SAMPLE_SCHEMA as SAMPLE_SCHEMA,
    )
    from hsx_dagster.core.storage.format import (
        SCALES_SUFFIX as SCALES_SUFFIX,
    )
    from hsx_dagster.core.storage.format import (
        SET_ASIDE_DIR as SET_ASIDE_DIR,
    )
    from hsx_dagster.core.storage.format import (
        SHARD_FILE as SHARD_FILE,
    )
    from hsx_dagster.core.storage.format import (
        SHARD_INDEX_FILE as SHARD_INDEX_FILE,
    )
    from hsx_dagster.core.storage.format import (
        SPLIT_BATCHES_FILE as SPLIT_BATCHES_FILE,
    )
    from hsx_dagster.core.storage.format import (
        STORAGE_DTYPES as STORAGE_DTYPES,
    )
    from hsx_dagster.core.storage.format import (
        TOKENIZED_REJECTS_FILE as TOKENIZED_REJECTS_FILE,
    )
    from hsx_dagster.core.storage.format import (
        TOKENIZED_SAMPLES_DIR as TOKENIZED_SAMPLES_DIR,
    )
    from hsx_dagster.core.storage.format import (
        TOKENIZED_SUMMARY_FILE as TOKENIZED_SUMMARY_FILE,
    )
    from hsx_dagster.core.storage.format import (
        TOKENIZED_VERSION as TOKENIZED_VERSION,
    )
    from hsx_dagster.core.storage.format import (
        VERIFIED_FILE as VERIFIED_FILE,
    )
    from hsx_dagster.core.storage.format import (
        FormatError as FormatError,
    )
    from hsx_dagster.core.storage.format import (
        check_drafter_manifest as check_drafter_manifest,
    )
    from hsx_dagster.core.storage.format import (
        dtype_name as dtype_name,
    )
    from hsx_dagster.core.storage.format import (
        tokenized_shard_file as tokenized_shard_file,
    )
    from hsx_dagster.core.storage.healing import set_aside_damaged as set_aside_damaged
    from hsx_dagster.core.storage.provenance import (
        FINAL_SLOT as FINAL_SLOT,
    )
    from hsx_dagster.core.storage.provenance import (
        MEANING as MEANING,
    )
    from hsx_dagster.core.storage.provenance import (
        ChunkLayout as ChunkLayout,
    )
    from hsx_dagster.core.storage.provenance import (
        ShardProvenance as ShardProvenance,
    )
    from hsx_dagster.core.storage.provenance import (
        StoredLayers as StoredLayers,
    )
    from hsx_dagster.core.storage.quantization import (
        FP8_MAX as FP8_MAX,
    )
    from hsx_dagster.core.storage.quantization import (
        block_size_for as block_size_for,
    )
    from hsx_dagster.core.storage.quantization import (
        bytes_per_vector as bytes_per_vector,
    )
    from hsx_dagster.core.storage.quantization import (
        dequantize as dequantize,
    )
    from hsx_dagster.core.storage.quantization import (
        quantize as quantize,
    )
    from hsx_dagster.core.storage.quantization import (
        scale_layout as scale_layout,
    )
    from hsx_dagster.core.storage.shard_membership import (
        chunks_with_changed_tokens as chunks_with_changed_tokens,
    )
    from hsx_dagster.core.storage.shard_membership import (
        shard_work as shard_work,
    )
    from hsx_dagster.core.storage.shard_records import (
        ChunkRecord as ChunkRecord,
    )
    from hsx_dagster.core.storage.shard_records import (
        ShardTotals as ShardTotals,
    )
    from hsx_dagster.core.storage.shard_records import (
        read_index as read_index,
    )
    from hsx_dagster.core.storage.shard_records import (
        read_quarantine as read_quarantine,
    )
    from hsx_dagster.core.storage.shard_records import (
        read_verified as read_verified,
    )
    from hsx_dagster.core.storage.shard_records import (
        record_verified as record_verified,
    )
    from hsx_dagster.core.storage.shard_records import (
        shard_totals as shard_totals,
    )
    from hsx_dagster.core.storage.shard_records import (
        verified_unchanged as verified_unchanged,
    )
    from hsx_dagster.core.storage.shard_store import ShardStore as ShardStore
    from hsx_dagster.core.storage.staging import RowSpec as RowSpec
    from hsx_dagster.core.storage.staging import Span as Span
    from hsx_dagster.core.storage.staging import StagingRing as StagingRing

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
        "check_drafter_manifest",
        "dtype_name",
        "tokenized_shard_file",
    ],
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
        "record_verified",
        "shard_totals",
        "verified_unchanged",
    ],
    "shard_store": ["ShardStore"],
    "staging": ["RowSpec", "Span", "StagingRing"],
}
if not TYPE_CHECKING:  # for mypy, the imports above are the package's names
    __all__, __getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
