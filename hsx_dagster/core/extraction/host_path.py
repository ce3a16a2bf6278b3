"""What a shard run does on the host beside the forward passes, in one place: the chunk writer (its staging ring
and its hashing thread: chunk_writer.py, chunk_file.py) and the run's share of the host's cores (host_share.py).

Per byte of states the host does one write (O_DIRECT where it pays: direct_io.py) and one hash; everything else is
done on the device before the copy (batch_states.py). Where the host's CPU time goes is accounted by part
(cpu_account.py). PyTorch's pool is sized to the run's share of the cores, so the shard runs of a box (one per
GPU) do not fight over them.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from hsx_dagster.core.extraction.backbone import BackboneInfo
from hsx_dagster.core.extraction.host_share import HostShare
from hsx_dagster.core.settings import ExtractionSettings
from hsx_dagster.core.settings.choices import parse_auto_or_positive
from hsx_dagster.core.storage.chunk_writer import ChunkWriter
from hsx_dagster.core.storage.cpu_account import CpuAccount
from hsx_dagster.core.storage.direct_io import choose_direct
from hsx_dagster.core.storage.provenance import ChunkLayout
from hsx_dagster.core.storage.shard_store import ShardStore


class HostPath:
    """A run's writer and share of the cores. On leaving, whatever was extracted is committed, even when the run
    stops on an error, and PyTorch's thread count is what it was. ``cpu``: where the host's CPU time is added, by
    part (cpu_account.py); ``direct``: how chunk files are written, in words (direct_io.py)."""

    def __init__(
        self,
        store: ShardStore,
        info: BackboneInfo,
        extraction: ExtractionSettings,
        metadata: dict[str, str],
        device: torch.device,
        cpu: CpuAccount | None = None,
    ) -> None:
        self.cpu = cpu or CpuAccount()
        direct, self.direct_io = choose_direct(extraction.direct_io, store.directory)
        self.threads_before = torch.get_num_threads()
        self.share = HostShare(extraction.device_lock_dir, parse_auto_or_positive(extraction.host_threads))
        self.hasher = ThreadPoolExecutor(1, thread_name_prefix="hsx-chunk-hash")
        layout = ChunkLayout(info.layers, info.hidden_size, extraction.storage_dtype)
        self.writer = ChunkWriter(
            store,
            layout.row_specs(),
            extraction.chunk_bytes,
            metadata,
            self.hasher,
            nan_policy=extraction.nan_policy,
            slot_names=info.layers.slot_names,
            pin_memory=device.type == "cuda",
            direct=direct,
            cpu=self.cpu,
        )

    def size_threads(self) -> None:
        """PyTorch's pool at this run's share of the cores; never above what the run started with (a caller's
        OMP_NUM_THREADS or set_num_threads), unless host_threads fixes a number."""
        threads = self.share.threads()
        if self.share.fixed is None:
            threads = min(threads, self.threads_before)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)

    def __enter__(self) -> HostPath:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.writer.close()
        finally:
            self.hasher.shutdown()
            self.share.close()
            torch.set_num_threads(self.threads_before)
