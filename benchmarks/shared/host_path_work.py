"""The host-path benchmark's work, run in a contestant's child process: a free backbone of real width, a shard of
generated samples, and the two ways through them (the device's part alone, the whole pipeline).

Imported after ``--previous`` may have put an earlier checkout first on ``sys.path``: the pipeline contestant then
runs that version's `extract_shard`, the device contestant always this one's. So what both versions run is imported
by the module paths every version has (the subpackages declared a public API only later), and `extract_shard`'s
logging callback is passed by the name that version's signature has (`progress` before `log_line`).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from benchmarks.shared.host_path_runs import MEAN_TOKENS, SEED, Config
from hsx_dagster.core.extraction.backbone import BackboneInfo
from hsx_dagster.core.settings import ExtractionSettings
from hsx_dagster.core.storage.format import STORAGE_DTYPES
from hsx_dagster.core.storage.provenance import ShardProvenance

VOCABULARY = 32_000
RUN_ID = "host-path-benchmark"  # the pipeline's checks take the digests its writer computed


class FreeBackbone:
    """A backbone whose forward costs nothing: every captured layer is a view of one random tensor of the real width
    (in the compute dtype, on the device), shaped as the batch."""

    def __init__(self, info: BackboneInfo, device: torch.device, dtype: torch.dtype, max_tokens: int) -> None:
        self.info = info
        self.model = torch.nn.Linear(1, 1, device=device)  # the engine reads the device off its parameters
        generator = torch.Generator(device="cpu").manual_seed(SEED)
        keys = info.layers.capture_keys
        base = torch.randn((max_tokens + 64 * len(keys), info.hidden_size), generator=generator, dtype=torch.float32)
        self._base = base.to(device=device, dtype=dtype)
        self._keys = keys

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict:
        rows, length = input_ids.shape
        tokens = rows * length
        return {key: self._base[64 * k : 64 * k + tokens].view(rows, length, -1) for k, key in enumerate(self._keys)}

    def close(self) -> None:
        pass


@dataclass
class Work:
    config: Config
    samples: pa.Table
    backbone: FreeBackbone
    extraction: ExtractionSettings
    provenance: ShardProvenance


def prepare(config: Config) -> Work:
    lengths = _lengths(config.tokens)
    rng = np.random.default_rng(SEED)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ids = pa.ListArray.from_arrays(
        pa.array(offsets), pa.array(rng.integers(0, VOCABULARY, offsets[-1], dtype=np.int32))
    )
    masks = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.ones(offsets[-1], dtype=np.uint8)))
    samples = pa.table({
        "sample_id": pa.array(np.arange(len(lengths), dtype=np.int64)), "input_ids": ids, "loss_mask": masks,
        "num_tokens": pa.array(lengths.astype(np.int32)),
    })  # fmt: skip
    layer_ids = tuple(range(config.slots - 1))
    device = torch.device(config.device)
    compute = torch.bfloat16 if device.type == "cuda" or config.dtype != "float8_e4m3" else torch.float32
    info = BackboneInfo("free", config.slots, config.slots, config.hidden, layer_ids, True, str(compute).split(".")[-1],
                        str(device), "none", 0)  # fmt: skip
    backbone = FreeBackbone(info, device, compute, max(config.max_batch_tokens, int(lengths.max())))
    extraction = ExtractionSettings(
        devices=[config.device], storage_dtype=config.dtype, batch_size=config.batch_size,
        max_batch_tokens=config.max_batch_tokens, chunk_mb=config.chunk_mb,
    )  # fmt: skip
    provenance = ShardProvenance(
        shard="shard-00", model_path="free", config_sha256="-", weights_index_sha256="-", layer_ids=layer_ids,
        include_final=True, storage_dtype=config.dtype, compute_dtype=info.compute_dtype, tokenized_sha256="-",
        model={"hidden_size": config.hidden, "num_hidden_layers": config.slots},
    )  # fmt: skip
    return Work(config, samples, backbone, extraction, provenance)


def _lengths(tokens: int) -> np.ndarray:
    """Sample lengths with mean about MEAN_TOKENS (a log-normal, as chat samples are), adding up to ``tokens``."""
    rng = np.random.default_rng(SEED + 1)
    lengths = np.clip(rng.lognormal(np.log(MEAN_TOKENS) - 0.32, 0.8, size=2 * tokens // MEAN_TOKENS + 8), 16, 4096)
    lengths = lengths.astype(np.int64)
    return lengths[: int(np.searchsorted(np.cumsum(lengths), tokens)) + 1]


def pipeline(work: Work, folder: Path, direct_io: str | None = None) -> int | tuple[int, dict]:
    """`extract_shard` into ``folder`` (``direct_io``: that setting instead of the default), then the shard checks'
    scan of it as the run that wrote it (integrity and numerics: coverage needs a tokenized shard); the bytes stored,
    and where a version accounts for its CPU time, its parts (CPU-seconds) with the checks' process CPU time."""
    from hsx_dagster.core.extraction.engine import extract_shard
    from hsx_dagster.core.storage.shard_store import ShardStore, read_index

    quiet = {"log_line" if "log_line" in inspect.signature(extract_shard).parameters else "progress": _ignore}
    accounted = "run_id" in inspect.signature(ShardStore).parameters  # an earlier checkout: no account, no run id
    extraction = work.extraction if direct_io is None else work.extraction.model_copy(update={"direct_io": direct_io})
    with ShardStore(folder, work.provenance, **({"run_id": RUN_ID} if accounted else {})) as store:
        report = extract_shard(
            "shard-00", work.samples, work.backbone, store, extraction,
            work.provenance.chunk_metadata(work.config.hidden), **quiet,
        )  # fmt: skip
    stored = sum(record.bytes for record in read_index(folder))
    if not accounted:
        return stored
    from hsx_dagster.core.dataset.shard_checks import integrity_outcome, numerics_outcome, scan_shard

    started = time.process_time()
    scan = scan_shard(folder, RUN_ID)
    passed = integrity_outcome(scan).passed and numerics_outcome(scan).passed
    checks_s = time.process_time() - started
    if not passed:
        raise RuntimeError(f"{folder}: the shard checks failed on the pipeline's own output")
    parts = {**report.host_cpu_s, "checks": round(checks_s, 4)}
    return stored, {"parts_s": parts, "direct_io": report.direct_io, "chunks_direct": report.chunks_direct,
                    "checks_bytes_hashed": scan.bytes_read}  # fmt: skip


def _ignore(message: str) -> None:
    """The run's messages, not shown: the benchmark prints its own."""


def device_only(work: Work) -> int:
    """The same batches through the device's part of `extract_shard` alone (forward, gather, reductions, fp8, the
    copy into staging rows, the ids and masks): one ring span reused, nothing written. The bytes it would store."""
    from hsx_dagster.core.extraction import LapTimer, LengthOrder, run_batch
    from hsx_dagster.core.storage import Span, StagingRing, statistics_specs

    info, config = work.backbone.info, work.config
    layout = work.provenance.layout(config.hidden)
    cuda = config.device == "cuda"
    specs = {**layout.row_specs(), **statistics_specs(info.layers.count)}
    lengths = work.samples.column("num_tokens").to_numpy().astype(np.int64)
    ring = StagingRing(specs, max(config.max_batch_tokens, int(lengths.max())), pin=cuda)
    order, timer = LengthOrder(lengths), LapTimer(torch.device(config.device))
    input_ids, loss_mask = (work.samples.column(name).combine_chunks() for name in ("input_ids", "loss_mask"))
    from hsx_dagster.core.storage import StagedBatch

    stored = 0
    storage = STORAGE_DTYPES[config.dtype]
    while len(order):
        batch = order.take(config.batch_size, config.max_batch_tokens)
        rows = np.asarray(batch.rows)
        staged = StagedBatch(rows.tolist(), lengths[rows].tolist(), ring, Span(0, 0, int(lengths[rows].sum())))
        run_batch(work.backbone, rows, input_ids, loss_mask, staged, storage, 0, timer)  # type: ignore[arg-type]
        if staged.ready is not None:
            staged.ready.synchronize()
        stored += staged.tokens * sum(spec.nbytes for spec in layout.row_specs().values())
    return stored
