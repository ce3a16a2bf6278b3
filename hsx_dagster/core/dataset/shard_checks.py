"""Checks of one hidden-state shard folder, from one read of each chunk (`scan_shard`), as `CheckOutcome`s.

They run on the partition a run has just materialized, so a damaged or incomplete shard is caught
on the shard that is wrong (where the retry sensor can act), not later on the assembled dataset:

- coverage: every tokenized sample of the shard is committed or quarantined exactly once, and the ids
  and loss mask stored beside each sample's states are the tokenized ones (committed samples whose input
  is gone are counted as departed, not served);
- integrity: every chunk the index lists exists, still has the sha256 recorded at write time,
  holds the samples the index says, and its header (format, shard, layers, dtype, tensor names,
  dtypes and shapes) matches the shard's provenance;
- numerics: no NaN/Inf in any stored state (fp8 de-quantised first); per-layer mean and std
  (a layer of zeros fails, an outlying scale is reported), from the statistics recorded when each chunk
  was written (its checksum proves they still describe its bytes).

Every chunk is read once for all three (chunk_scan.py): about the time of ``sha256sum`` over the shard. A chunk
these checks read whole before and whose file has not changed since (size, mtime and inode, verified.json) is not
read again: its header and sample ids are (integrity), and its ids and masks only when the tokenized shard changed
since they were found equal to it (coverage); its statistics are those recorded at write time (numerics). So a
shard that grew by 1% is re-hashed by 1%; the check metadata says how many chunks and bytes were hashed and skipped.
The chunks the run being checked wrote itself are not read whole either (one hash per byte): its writer hashed their
bytes from memory as it wrote them, and while each file is the one it committed (size, mtime, ctime and inode as in
written.jsonl) its digest is taken; a chunk changed or replaced since is hashed as any other.
With ``heal=True`` (the Dagster check), a damaged or missing chunk is then taken out of the index (moved to
``set_aside/`` with the reason, healing.py): its samples are pending, and the next run of the shard (the retry
sensor's) extracts exactly those again.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

from hsx_dagster.core.check_outcome import CheckOutcome
from hsx_dagster.core.inputs.tokenized import shard_digests
from hsx_dagster.core.model.info import ModelDirError, ModelInfo
from hsx_dagster.core.storage.atomic import StoreError
from hsx_dagster.core.storage.chunk_checks import (
    MAX_LISTED,
    LayerStatistics,
    TokenizedRows,
    positions_of,
    scanned_chunk_problems,
)
from hsx_dagster.core.storage.chunk_scan import SMALL_TENSORS, ScannedChunk, read_verified_chunk, scan_chunk
from hsx_dagster.core.storage.format import COMPLETE_FILE, tokenized_shard_file
from hsx_dagster.core.storage.healing import set_aside_damaged
from hsx_dagster.core.storage.provenance import ChunkLayout, ShardProvenance
from hsx_dagster.core.storage.shard_records import (
    ChunkRecord,
    read_index,
    read_quarantine,
    read_verified,
    read_written,
    record_verified,
    verified_unchanged,
    written_unchanged,
)

CHECK_NAMES = ("shard_coverage", "shard_integrity", "shard_numerics")


def layout_of(provenance: ShardProvenance) -> ChunkLayout:
    """The layout every chunk of the shard has: the recorded width (the model's config for shards written before
    shard.json recorded it)."""
    hidden = provenance.hidden_size or ModelInfo.read(provenance.model_path).require_hidden_size()
    return provenance.layout(hidden)


@dataclass
class ShardScan:
    """Every chunk of a shard read once (or known unchanged since it was): what each holds and what is wrong."""

    folder: Path
    provenance: ShardProvenance
    records: list[ChunkRecord]
    chunks: dict[str, ScannedChunk] = field(default_factory=dict)
    problems: dict[str, list[str]] = field(default_factory=dict)  # chunk -> what is wrong (integrity)
    elapsed_s: float = 0.0
    started_ns: int = 0  # wall clock when the scan began: what verified.json records as the time of verification
    verified: dict = field(default_factory=dict)  # verified.json as the scan found it
    skipped: set[str] = field(default_factory=set)  # verified before and unchanged: not hashed again
    trusted: set[str] = field(default_factory=set)  # written and hashed by the run being checked, unchanged since
    matched: dict[str, str] = field(default_factory=dict)  # chunk -> tokenized digest its ids and masks equal

    @property
    def bytes_read(self) -> int:
        """Bytes hashed (chunks read whole)."""
        return sum(chunk.size for name, chunk in self.chunks.items() if name not in self.skipped | self.trusted)

    @property
    def bytes_skipped(self) -> int:
        return sum(self.chunks[name].size for name in self.skipped)

    @property
    def bytes_trusted(self) -> int:
        return sum(self.chunks[name].size for name in self.trusted)

    def figures(self) -> dict:
        """What the scan read and skipped, for every check's metadata."""
        return {
            "scan_s": round(self.elapsed_s, 3),
            "scan_bytes": self.bytes_read,
            "scan_mb_per_s": round(self.bytes_read / 2**20 / self.elapsed_s, 1) if self.elapsed_s > 0 else 0.0,
            "chunks_hashed": len(self.chunks) - len(self.skipped) - len(self.trusted),
            "chunks_skipped": len(self.skipped),  # verified before, unchanged since (verified.json)
            "bytes_skipped": self.bytes_skipped,
            "chunks_from_writer": len(self.trusted),  # hashed by this run's writer, unchanged since (written.jsonl)
            "bytes_from_writer": self.bytes_trusted,
        }


def scan_shard(folder: Path, run_id: str | None = None) -> ShardScan:
    """Read every chunk of the index once, except those verified before and unchanged since (their header and
    sample ids only) and those run ``run_id`` wrote, unchanged since (header, ids and masks only);
    StoreError/ModelDirError when shard.json or the index is unusable."""
    started = time.perf_counter()
    provenance = ShardProvenance.read(folder)
    layout, header = layout_of(provenance), provenance.chunk_header()
    scan = ShardScan(Path(folder), provenance, read_index(folder), started_ns=time.time_ns())
    scan.verified = read_verified(scan.folder)
    written = read_written(scan.folder, run_id)
    for record in scan.records:
        path = scan.folder / record.chunk
        scanned = None
        if verified_unchanged(scan.folder, record, scan.verified):
            scanned = read_verified_chunk(path, record.sha256)
            if scanned.error is None:
                scan.skipped.add(record.chunk)
            else:
                scanned = None  # it changed after all: read whole, named by what that finds
        elif written_unchanged(scan.folder, record, written):
            scanned = read_verified_chunk(path, record.sha256, small=SMALL_TENSORS)  # new: coverage compares them
            if scanned.error is None:
                scan.trusted.add(record.chunk)
            else:
                scanned = None
        scanned = scanned or scan_chunk(path)
        scan.chunks[record.chunk] = scanned
        problems = scanned_chunk_problems(scanned, record, layout, header)
        if problems:
            scan.problems[record.chunk] = problems
    scan.elapsed_s = time.perf_counter() - started
    return scan


def integrity_outcome(scan: ShardScan) -> CheckOutcome:
    problems = [problem for listed in scan.problems.values() for problem in listed]
    size = sum(r.bytes for r in scan.records)
    notes = []
    if scan.skipped:
        notes.append(f"{len(scan.skipped)} of them verified before and unchanged since: not hashed again")
    if scan.trusted:
        notes.append(f"{len(scan.trusted)} written by this run, checksums as its writer computed them")
    skipped = f" ({'; '.join(notes)})" if notes else ""
    return CheckOutcome(
        not problems,
        "; ".join(problems[:MAX_LISTED])
        or f"{len(scan.records)} chunks: checksums, samples, headers, shapes and dtypes as recorded{skipped}",
        {"chunks": len(scan.records), "bytes": size, "bytes_read": scan.bytes_read, "problems": len(problems)},
    )


def numerics_outcome(scan: ShardScan) -> CheckOutcome:
    """From the recorded statistics of every chunk whose checksum holds; a damaged chunk is read for its states
    (to name what it holds), an unreadable one is named."""
    stats = LayerStatistics(scan.provenance.layers)
    unreadable = []
    for record in scan.records:
        path = scan.folder / record.chunk
        try:
            if record.chunk in scan.problems:
                stats.add_chunk(path)
            else:
                stats.add(path, record)
        except Exception as exc:  # a damaged chunk: named here, the integrity check says what is wrong with it
            unreadable.append(f"{record.chunk} ({type(exc).__name__})")
    outcome = stats.outcome()
    if unreadable:
        outcome = CheckOutcome(
            False,
            f"{len(unreadable)} chunks unreadable: {', '.join(unreadable[:MAX_LISTED])}; {outcome.description}",
            {**outcome.metadata, "unreadable_chunks": len(unreadable)},
        )
    return outcome


def coverage_outcome(scan: ShardScan, tokenized_dir: Path, shard: str) -> CheckOutcome:
    """Every tokenized sample of ``shard`` committed or quarantined exactly once, with its ids and mask. A chunk
    verified unchanged whose ids and masks were found equal to this same tokenized shard (its digest) is not
    compared again; ``scan.matched`` gets every chunk found equal."""
    source = tokenized_shard_file(tokenized_dir, shard)
    if not source.is_file():
        return CheckOutcome(False, f"{source} not found: nothing to compare the shard with", {"problems": 1})
    digest = shard_digests(tokenized_dir, [shard])[shard]
    sample_ids = pq.read_table(source, columns=["sample_id"]).column("sample_id").to_numpy()
    try:
        quarantined = [q.sample_id for q in read_quarantine(scan.folder)]
    except (StoreError, TypeError) as exc:
        return CheckOutcome(False, f"coverage: {exc}", {"problems": 1})
    rows = set(sample_ids.tolist())
    committed = Counter(sample_id for record in scan.records for sample_id in record.sample_ids)
    accounted = committed + Counter(q for q in quarantined if q in rows)
    twice = sorted(sample_id for sample_id, n in accounted.items() if n > 1)
    missing = sorted(sample_id for sample_id in rows if sample_id not in accounted)
    # committed samples whose input is gone (stable membership): kept in their chunk, never indexed or served
    departed = sorted(sample_id for sample_id in committed if sample_id not in rows)
    mismatched, compared = _compare_ids_and_masks(scan, source, digest)
    problems = _coverage_problems(missing, twice, mismatched)
    if not problems and not (scan.folder / COMPLETE_FILE).is_file():
        problems.append(f"{scan.folder / COMPLETE_FILE} is missing: the shard was not marked complete")
    set_aside = f" ({len(quarantined)} of them quarantined with a reason)" if quarantined else ""
    return CheckOutcome(
        not problems,
        "; ".join(problems)
        or f"all {len(rows)} tokenized samples of {shard} accounted for once, ids and masks identical{set_aside}",
        {
            "tokenized_samples": len(rows),
            "committed": sum(committed.values()) - len(departed),
            "quarantined": len(quarantined),
            "missing": len(missing),
            "duplicated": len(twice),
            "departed": len(departed),
            "mismatched": len(mismatched),
            "chunks_compared": compared,  # the others: found equal to this tokenized shard before, unchanged since
        },
    )


def _compare_ids_and_masks(scan: ShardScan, source: Path, digest: str) -> tuple[list[int], int]:
    """The samples whose stored ids or mask differ from the tokenized ones, and how many chunks were compared: those
    read whole now, and the unchanged ones last found equal to another tokenized shard (their ids and masks read)."""
    tokenized: TokenizedRows | None = None  # read only when a chunk needs comparing
    mismatched: list[int] = []
    compared = 0
    for record in scan.records:
        scanned = scan.chunks.get(record.chunk)
        if scanned is None or scanned.error is not None:
            continue  # a missing or unreadable chunk is the integrity check's finding
        if record.chunk in scan.skipped and scan.verified[record.chunk].get("tokenized") == digest:
            scan.matched[record.chunk] = digest
            continue
        if tokenized is None:
            tokenized = TokenizedRows(pq.read_table(source, columns=["sample_id", "input_ids", "loss_mask"]))
        small = scanned.small
        if "input_ids" not in small:  # verified unchanged: its ids and masks, not its states
            small = read_verified_chunk(scanned.path, record.sha256, small=SMALL_TENSORS).small
        found = tokenized.mismatching(small, positions_of(record.sample_ids))
        compared += 1
        mismatched += found
        if not found:
            scan.matched[record.chunk] = digest
    return mismatched, compared


def _coverage_problems(missing: list[int], twice: list[int], mismatched: list[int]) -> list[str]:
    problems = []
    if missing:
        problems.append(f"{len(missing)} samples neither committed nor quarantined (e.g. {missing[:MAX_LISTED]})")
    if twice:
        problems.append(f"{len(twice)} samples committed or quarantined more than once (e.g. {twice[:MAX_LISTED]})")
    if mismatched:
        problems.append(
            f"{len(mismatched)} samples' stored ids or loss mask differ from the tokenized ones "
            f"(e.g. {sorted(mismatched)[:MAX_LISTED]})"
        )
    return problems


def check_shard(
    shard_dir: Path, tokenized_dir: Path, shard: str, *, heal: bool = False, run_id: str | None = None
) -> dict[str, CheckOutcome]:
    """The three checks from one read of the shard (``CHECK_NAMES`` -> outcome); with ``heal``, damaged chunks
    are then set aside so that the next run re-extracts their samples; ``run_id``: the run that just extracted the
    shard, whose writer's digests are taken for its chunks unchanged since. Each outcome's metadata carries the
    read's time and speed."""
    shard_dir = Path(shard_dir)
    cpu_started = time.process_time()
    try:
        scan = scan_shard(shard_dir, run_id)
    except (StoreError, ModelDirError) as exc:
        return {
            name: CheckOutcome(False, f"{name.removeprefix('shard_')}: {exc}", {"problems": 1}) for name in CHECK_NAMES
        }
    outcomes = {
        "shard_coverage": coverage_outcome(scan, tokenized_dir, shard),
        "shard_integrity": integrity_outcome(scan),
        "shard_numerics": numerics_outcome(scan),
    }
    kept = {chunk: scan.verified[chunk] for chunk in scan.skipped}
    whole = [record for record in scan.records if record.chunk not in scan.problems]
    record_verified(shard_dir, whole, scan.started_ns, tokenized=scan.matched, kept=kept)
    healed = set_aside_damaged(shard_dir, scan.records, scan.problems) if heal and scan.problems else []
    if healed:
        samples = sum(record.samples for record in healed)
        integrity = outcomes["shard_integrity"]
        outcomes["shard_integrity"] = CheckOutcome(
            False,
            f"{integrity.description}; set aside {len(healed)} chunks (moved to set_aside/, reason in "
            f"removed_chunks.jsonl): their {samples} samples are pending, the next run of {shard} re-extracts them",
            {**integrity.metadata, "chunks_set_aside": len(healed), "samples_pending": samples},
        )
    speed = {**scan.figures(), "checks_cpu_s": round(time.process_time() - cpu_started, 4)}  # the process's, in full
    return {name: CheckOutcome(o.passed, o.description, {**o.metadata, **speed}) for name, o in outcomes.items()}
