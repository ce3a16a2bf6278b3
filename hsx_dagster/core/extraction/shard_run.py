"""One shard run end to end: pick the device, check the inputs and the output folder, load the
backbone, extract what is not committed yet, and mark the shard complete.

Everything that can be wrong with the inputs is checked before the model loads.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from hsx_dagster.core.extraction.backbone import BackboneInfo, load_backbone
from hsx_dagster.core.extraction.batch_shape import BUDGET_FRACTION
from hsx_dagster.core.extraction.devices import device_claim
from hsx_dagster.core.extraction.disk_reservations import RESERVATIONS_DIR, DiskReservation, pending_writes, reserve
from hsx_dagster.core.extraction.engine import ExtractionReport, extract_shard
from hsx_dagster.core.extraction.kernels import describe_kernels, kernels_record
from hsx_dagster.core.extraction.progress import Progress
from hsx_dagster.core.extraction.size_estimate import StoredShape, check_free_disk, estimate_bytes, format_bytes
from hsx_dagster.core.inputs.tokenized import read_tokenized_shard, tokenized_digest
from hsx_dagster.core.model.info import ModelInfo, check_model_dir
from hsx_dagster.core.settings import ExtractionSettings, ModelSettings, Settings
from hsx_dagster.core.storage.atomic import StoreError
from hsx_dagster.core.storage.format import (
    COMPLETE_FILE,
    COMPUTE_DTYPES,
    STORAGE_DTYPES,
    dtype_name,
)
from hsx_dagster.core.storage.provenance import MEANING as PROVENANCE_MEANING, ShardProvenance
from hsx_dagster.core.storage.shard_membership import chunks_with_changed_tokens
from hsx_dagster.core.storage.shard_store import ShardStore, ShardTotals, read_quarantine, shard_totals

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardJob:
    """One shard run: which shard, where its samples and states are, and the settings sections that say what
    to extract (``model``) and how (``extraction``), as the settings file declares them."""

    shard: str
    shard_index: int
    tokenized_dir: Path
    output_dir: Path  # <output_dir>/hidden_states/<shard>
    model: ModelSettings
    layer_ids: tuple[int, ...]  # model.layers resolved for the model's layer count
    extraction: ExtractionSettings
    owner: str = "hsx"  # who holds the device, for the message another run sees (e.g. the Dagster run id)
    probe_budget: float = BUDGET_FRACTION  # share of the run the batch shape probes may cost (auto shapes)
    run_id: str = ""  # the Dagster run's id: its shard checks take the digests this run's writer computed

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        shard: str,
        extraction: ExtractionSettings | None = None,
        owner: str = "hsx",
        run_id: str = "",
    ) -> ShardJob:
        """The job for one shard of ``settings``; ``extraction`` overrides its extraction section (run config).
        A key that is not one of the shards is a SettingsError naming `shards`."""
        return cls(
            shard=shard,
            shard_index=settings.shard_index(shard),
            tokenized_dir=settings.tokenized_dir,
            output_dir=settings.shard_dir(shard),
            model=settings.model,
            layer_ids=tuple(settings.layer_ids),
            extraction=extraction or settings.extraction,
            owner=owner,
            run_id=run_id,
        )


@dataclass
class ShardResult:
    report: ExtractionReport
    backbone: BackboneInfo | None  # None when every sample was already done and no model was loaded
    compute_dtype: str
    totals: ShardTotals  # over every committed chunk of the shard, this run's and earlier ones
    quarantined: int  # samples of the shard set aside with a reason, by this run and earlier ones
    current: int = 0  # committed samples that are among the shard's tokenized samples (what the dataset serves)
    departed: int = 0  # committed samples no longer in the inputs (kept in chunks that still hold current ones)
    reclaimed_chunks: int = 0  # chunks deleted by this run: none of their samples is in the inputs any more
    redone_chunks: int = 0  # chunks taken out by this run because their samples' tokens changed (start_over)
    device_claim: str = ""  # how the run holds its device, in words (a lock on the GPU's UUID, the scheduler's)


def resolve_compute_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return COMPUTE_DTYPES[name]


def run_shard(
    job: ShardJob,
    log_line: Callable[[str], None] | None = None,
    on_batch_progress: Callable[[Progress], None] | None = None,
    warn: Callable[[str], None] | None = None,
) -> ShardResult:
    """``log_line`` takes the run's messages, ``warn`` its warnings (default: the log); ``on_batch_progress``,
    when given, the extraction's `Progress` after every batch."""
    log_line = log_line or log.info
    _require_shared_inputs(job)
    table = read_tokenized_shard(
        job.tokenized_dir, job.shard, columns=["sample_id", "input_ids", "loss_mask", "num_tokens"]
    )
    model = check_model_dir(job.model.path)  # what the run knows of the model from here on, read once
    extraction = job.extraction
    with device_claim(
        extraction.devices,
        job.shard_index,
        owner=job.owner,
        lock_dir=extraction.device_lock_dir,
        wait_s=extraction.device_wait_s,
        claim=extraction.device_claim,
    ) as claim:
        log_line(f"{job.shard}: device {claim.device}, claim: {claim.how}")
        result = _run_on_device(job, model, table, torch.device(claim.device), log_line, on_batch_progress, warn)
        result.device_claim = claim.how
        return result


def _require_shared_inputs(job: ShardJob) -> None:
    """On a cluster the run lands on any node: the tokenized shard (under the shared output_dir) and the model must
    be there, at the paths the settings name."""
    host = socket.gethostname()
    if not job.tokenized_dir.is_dir():
        raise FileNotFoundError(
            f"{job.tokenized_dir} does not exist on {host}: materialize tokenized_dataset first, and on a cluster "
            "put output_dir on storage every node mounts at the same path (docs/cluster.md)"
        )
    if not job.model.path.is_dir():
        raise FileNotFoundError(
            f"model.path {job.model.path} does not exist on {host}: every node that runs shards needs the model at "
            "the same path (docs/cluster.md)"
        )


def _run_on_device(
    job: ShardJob,
    model: ModelInfo,
    table: pa.Table,
    device: torch.device,
    log_line: Callable[[str], None],
    on_batch_progress: Callable[[Progress], None] | None = None,
    warn: Callable[[str], None] | None = None,
) -> ShardResult:
    extraction = job.extraction
    compute_dtype = resolve_compute_dtype(extraction.compute_dtype, device)
    prints = model.fingerprint()
    provenance = ShardProvenance(
        shard=job.shard,
        model_path=str(job.model.path),
        config_sha256=prints["config_sha256"],
        weights_index_sha256=prints["weights_index_sha256"],
        layer_ids=tuple(job.layer_ids),
        layer_preset=job.model.layer_preset,
        model=model.describe(),  # layer count, width and architecture of the text model
        include_final=job.model.include_final,
        storage_dtype=extraction.storage_dtype,
        compute_dtype=dtype_name(compute_dtype),
        tokenized_sha256=tokenized_digest(table),
    )
    with (
        ShardStore(
            job.output_dir, provenance, on_mismatch=extraction.on_mismatch, report=log_line, run_id=job.run_id
        ) as store,
        ExitStack() as held,
    ):
        (job.output_dir / COMPLETE_FILE).unlink(missing_ok=True)
        changes = _follow_the_inputs(job, store, table, log_line)
        todo = store.pending_mask(table.column("sample_id").to_numpy())
        held.enter_context(_check_disk_space(job, model, table, todo))  # counted by the other shards until we end
        if not todo.any():
            log_line(f"{job.shard}: all {table.num_rows} samples are already extracted; the model is not loaded")
            nothing = ExtractionReport.nothing_to_do(job.shard, table.num_rows, device)
            return _finish(job, table, store, provenance, nothing, None, changes)
        log_line(
            f"{job.shard}: {int(todo.sum())} of {table.num_rows} samples to extract on {device} "
            f"({provenance.compute_dtype} compute, "
            f"{extraction.storage_dtype} storage), layers {list(job.layer_ids)}"
        )
        backbone = load_backbone(
            model,
            job.layer_ids,
            include_final=job.model.include_final,
            device=device,
            compute_dtype=compute_dtype,
            attn_implementation=extraction.attn_implementation,
            trust_remote_code=job.model.trust_remote_code,
            warn=warn,
        )
        log_line(f"{job.shard}: {describe_kernels(backbone.info.attn_implementation, backbone.info.kernels)}")
        try:
            result = extract_shard(
                job.shard,
                table,
                backbone,
                store,
                extraction,
                provenance.chunk_metadata(backbone.info.hidden_size),
                pad_token_id=_pad_token_id(backbone),
                probe_budget=job.probe_budget,
                log_line=log_line,
                pending=todo,
                on_batch_progress=on_batch_progress,
            )
        finally:
            backbone.close()
        return _finish(job, table, store, provenance, result, backbone.info, changes)


def _follow_the_inputs(job: ShardJob, store: ShardStore, table: pa.Table, log_line: Callable[[str], None]) -> dict:
    """Before anything is extracted: delete the chunks holding only samples that left the inputs, and refuse
    (or with start_over, take out) chunks whose samples were tokenized differently since."""
    current = table.column("sample_id").to_numpy()
    reclaimed = store.reclaim(current)
    if reclaimed:
        samples = sum(record.samples for record in reclaimed)
        log_line(f"{job.shard}: deleted {len(reclaimed)} chunks whose {samples} samples all left the inputs")
    changed = chunks_with_changed_tokens(job.output_dir, store.records, table)
    if changed and job.extraction.on_mismatch != "start_over":
        samples = sum(count for _, count in changed)
        raise StoreError(
            f"{job.output_dir}: {samples} committed samples in {len(changed)} chunks were tokenized differently "
            f"(tokenized_sha256: {PROVENANCE_MEANING['tokenized_sha256']}; their token ids or loss masks differ "
            "from the tokenized ones). Refusing to mix them. To re-extract those chunks, set "
            "extraction.on_mismatch: start_over"
        )
    store.remove([(record, "tokens_changed", f"{count} samples tokenized differently") for record, count in changed])
    if changed:
        log_line(f"{job.shard}: {len(changed)} chunks tokenized differently since were taken out; re-extracting them")
    return {"reclaimed_chunks": len(reclaimed), "redone_chunks": len(changed)}


def _finish(
    job: ShardJob,
    table: pa.Table,
    store: ShardStore,
    provenance: ShardProvenance,
    result: ExtractionReport,
    info: BackboneInfo | None,
    changes: dict,
) -> ShardResult:
    totals = shard_totals(job.output_dir)
    current_ids = np.asarray(table.column("sample_id").to_numpy(), dtype=np.int64)
    committed = np.fromiter((i for r in store.records for i in r.sample_ids), dtype=np.int64)
    current = int(np.isin(committed, current_ids).sum())
    quarantined = int(np.isin([q.sample_id for q in read_quarantine(job.output_dir)], current_ids).sum())
    if current + quarantined != table.num_rows:
        raise RuntimeError(
            f"{job.shard}: {current} samples committed and {quarantined} quarantined, expected {table.num_rows}"
        )
    departed = len(committed) - current
    store.mark_complete(
        {
            **totals.to_dict(),
            "current_samples": current,
            "departed_samples": departed,
            "quarantined": quarantined,
            "provenance": provenance.to_dict(),
            "last_run": {**result.to_dict(), **changes, **_kernels(info)},
        }
    )
    return ShardResult(result, info, provenance.compute_dtype, totals, quarantined, current, departed, **changes)


def _kernels(info: BackboneInfo | None) -> dict:
    """The attention and linear-attention implementations the run used, for ``last_run`` (none: no model loaded)."""
    return {"kernels": kernels_record(info.attn_implementation, info.kernels)} if info else {}


def _check_disk_space(job: ShardJob, model: ModelInfo, table: pa.Table, todo: np.ndarray) -> DiskReservation:
    """Before the model loads: the samples still to extract (``todo``, a row mask) must fit on the output disk,
    beside what the other running shards will still write there; this run's own estimate is recorded for them."""
    tokens = int(table.column("num_tokens").to_numpy()[todo].sum())
    shape = StoredShape.of_model(model, job.layer_ids, job.model.include_final)
    extraction = job.extraction
    needed = estimate_bytes(tokens, int(todo.sum()), shape, extraction.storage_dtype, extraction.chunk_bytes)
    alternative = ""
    if STORAGE_DTYPES[extraction.storage_dtype].itemsize > 1:
        fp8 = estimate_bytes(tokens, int(todo.sum()), shape, "float8_e4m3", extraction.chunk_bytes)
        alternative = f", or store float8_e4m3 (extraction.storage_dtype; about {format_bytes(fp8)})"
    records = job.output_dir.parent.parent / RESERVATIONS_DIR  # <output_dir>/disk_reservations (shared, like it)
    reservation = reserve(records, job.shard, job.output_dir, needed)  # first: a shard starting now counts ours
    try:
        others = [(other.shard, other.remaining) for other in pending_writes(records, own=reservation)]
        check_free_disk(job.output_dir, needed, alternative, others)
    except BaseException:
        reservation.release()
        raise
    return reservation


def _pad_token_id(backbone) -> int:
    config = backbone.model.config
    pad = getattr(config, "pad_token_id", None)
    return int(pad) if isinstance(pad, int) else 0  # padded positions are masked and never stored
