"""Data-quality checks on an assembled drafter dataset, each a plain function returning a `CheckOutcome`.

- coverage: every tokenized sample is in the dataset exactly once, with the same ids and mask;
- integrity: every chunk still has the checksum recorded when it was written; shapes, dtypes and
  layer count match the manifest;
- numerics: no NaN/Inf (fp8 states de-quantised first); per-layer mean/std (a layer of zeros fails;
  an odd scale is reported);
- parity: random samples re-extracted one at a time by an independent reference forward pass
  (unpadded, ``output_hidden_states``, only the decoder layers needed) match the stored tensors within
  the storage dtype's tolerance. This is what catches batching, padding and ordering bugs on real runs.

The Dagster asset checks are thin wrappers over these.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from safetensors import safe_open

from hsx_dagster.core.check_outcome import CheckOutcome
from hsx_dagster.core.dataset.manifest import Manifest
from hsx_dagster.core.dataset.reader import DrafterDataset
from hsx_dagster.core.extraction.devices import claimed_device
from hsx_dagster.core.inputs.tokenized import read_tokenized_shard, shard_digests
from hsx_dagster.core.storage.chunk_checks import (
    MAX_LISTED,
    LayerStatistics,
    TokenizedRows,
    chunk_problems,
    scanned_chunk_problems,
)
from hsx_dagster.core.storage.chunk_scan import read_verified_chunk
from hsx_dagster.core.storage.format import COMPUTE_DTYPES, DRAFTER_INDEX_FILE, DRAFTER_QUARANTINE_FILE
from hsx_dagster.core.storage.provenance import ChunkLayout, chunk_header
from hsx_dagster.core.storage.shard_records import read_verified, verified_unchanged
from hsx_dagster.core.storage.shard_store import StoreError, read_index

# Relative L2 error per token allowed by the storage dtype (its rounding), and added when the
# reference and the batched run compute in a reduced precision (their rounding paths differ).
# fp8 e4m3 with block scales: measured errors per token on the demo model are in docs/benchmarks.md.
STORAGE_TOLERANCE = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1e-2, "float8_e4m3": 6e-2}
REDUCED_COMPUTE_TOLERANCE = 4e-2


def check_coverage(drafter_dir: Path, tokenized_dir: Path) -> CheckOutcome:
    """Every tokenized sample in the index exactly once (or quarantined), at a place of its chunk that holds it,
    with the tokenized ids and mask. A chunk its shard's checks verified unchanged and found equal to the same
    tokenized shard (verified.json) is not read: its index record says what it holds. Index columns as numpy
    arrays, not Python objects per sample."""
    manifest = Manifest.read(drafter_dir)
    root = manifest.chunks_dir(drafter_dir)
    index = pq.read_table(drafter_dir / DRAFTER_INDEX_FILE, columns=["sample_id", "chunk", "position"])
    sample_ids = index.column("sample_id").to_numpy()
    unique, counts = np.unique(sample_ids, return_counts=True)
    duplicated = unique[counts > 1].tolist()
    problems: list[str] = []
    if duplicated:
        problems.append(f"{len(duplicated)} samples appear more than once (e.g. {duplicated[:MAX_LISTED]})")
    # Samples set aside during extraction (with a reason) are accounted for, not missing.
    quarantine_file = drafter_dir / DRAFTER_QUARANTINE_FILE
    quarantined = (
        pq.read_table(quarantine_file).column("sample_id").to_numpy()
        if quarantine_file.is_file()
        else np.zeros(0, dtype=np.int64)
    )
    stored_and_quarantined = np.intersect1d(quarantined, unique).tolist()
    if stored_and_quarantined:
        problems.append(
            f"{len(stored_and_quarantined)} quarantined samples are also stored (e.g. "
            f"{stored_and_quarantined[:MAX_LISTED]})"
        )
    by_chunk = _rows_by_chunk(index)
    expected_total, missing, mismatched, compared = 0, [], [], 0
    digests = shard_digests(tokenized_dir, manifest.shard_keys)
    for shard in manifest.shard_keys:
        ids = read_tokenized_shard(tokenized_dir, shard, columns=["sample_id"]).column("sample_id").to_numpy()
        expected_total += len(ids)
        missing += ids[~np.isin(ids, unique) & ~np.isin(ids, quarantined)].tolist()
        found, count = _shard_mismatches(root, shard, by_chunk, tokenized_dir, digests[shard])
        mismatched += found
        compared += count
    if missing:
        problems.append(f"{len(missing)} tokenized samples are missing (e.g. {sorted(missing)[:MAX_LISTED]})")
    if mismatched:
        problems.append(
            f"{len(mismatched)} samples differ from the tokenized dataset or sit at the wrong place "
            f"(e.g. {sorted(set(mismatched))[:MAX_LISTED]})"
        )
    if index.num_rows - len(duplicated) > expected_total - len(quarantined) and not problems:
        problems.append(f"{index.num_rows} samples in the index for {expected_total} tokenized samples")
    set_aside = f" ({len(quarantined)} more quarantined with a reason)" if len(quarantined) else ""
    return CheckOutcome(
        not problems,
        "; ".join(problems)
        or f"all {expected_total - len(quarantined)} tokenized samples present once, ids and masks identical"
        f"{set_aside}",
        {
            "samples_in_index": index.num_rows,
            "tokenized_samples": expected_total,
            "quarantined": len(quarantined),
            "duplicated": len(duplicated),
            "missing": len(missing),
            "mismatched": len(mismatched),
            "chunks_compared": compared,  # the others: verified unchanged by the shard checks, against this shard
        },
    )


def _rows_by_chunk(index: pa.Table) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Chunk name -> (sample ids, positions) of its index rows, grouped with numpy."""
    column = pc.dictionary_encode(index.column("chunk")).combine_chunks()
    codes = column.indices.to_numpy(zero_copy_only=False)
    names = column.dictionary.to_pylist()
    sample_ids, positions = index.column("sample_id").to_numpy(), index.column("position").to_numpy()
    order = np.argsort(codes, kind="stable")
    starts = np.searchsorted(codes[order], np.arange(len(names) + 1))
    return {
        name: (sample_ids[order[starts[k] : starts[k + 1]]], positions[order[starts[k] : starts[k + 1]]])
        for k, name in enumerate(names)
    }


def _shard_mismatches(
    root: Path, shard: str, by_chunk: dict[str, tuple[np.ndarray, np.ndarray]], tokenized_dir: Path, digest: str
) -> tuple[list[int], int]:
    """The index's samples of ``shard`` not held where it says, or whose ids or mask differ from the tokenized ones;
    and how many chunks were read to compare."""
    folder = root / "hidden_states" / shard
    try:
        records = {record.chunk: record for record in read_index(folder)}
    except StoreError:
        records = {}  # the integrity check names the index; every chunk here is read
    verified = read_verified(folder)
    tokenized: TokenizedRows | None = None
    mismatched: list[int] = []
    compared = 0
    for chunk_name in sorted(c for c in by_chunk if f"/{shard}/" in c):
        ids, positions = by_chunk[chunk_name]
        record = records.get(Path(chunk_name).name)
        entry = verified.get(Path(chunk_name).name) or {}
        if record is not None and entry.get("tokenized") == digest and verified_unchanged(folder, record, verified):
            held = np.asarray(record.sample_ids, dtype=np.int64)  # what the shard checks found the chunk to hold
            inside = positions < len(held)
            placed = inside & (held[np.minimum(positions, max(len(held) - 1, 0))] == ids)
            mismatched += ids[~placed].tolist()
            continue
        if tokenized is None:
            table = read_tokenized_shard(tokenized_dir, shard, columns=["sample_id", "input_ids", "loss_mask"])
            tokenized = TokenizedRows(table)
        compared += 1
        mismatched += tokenized.mismatching(
            _small_tensors(root / chunk_name), dict(zip(ids.tolist(), positions.tolist()))
        )
    return mismatched, compared


def check_integrity(drafter_dir: Path) -> CheckOutcome:
    """Every chunk as written: a chunk its shard's checks read whole and that has not changed since (size, mtime,
    inode; verified.json) is not read again, only its header; every other chunk is read and hashed."""
    manifest = Manifest.read(drafter_dir)
    root = manifest.chunks_dir(drafter_dir)
    layout = ChunkLayout(manifest.layers.stored, manifest.hidden_size, manifest.storage_dtype)
    problems: list[str] = []
    checked = total_bytes = reused = 0
    for shard in manifest.shard_keys:
        folder = root / "hidden_states" / shard
        try:
            records = read_index(folder)
        except StoreError as exc:  # a garbled index line: the check fails naming it, it does not crash
            problems.append(str(exc))
            continue
        verified = read_verified(folder)
        header = chunk_header(shard, manifest.layers.stored, manifest.storage_dtype)
        for record in records:
            path = folder / record.chunk
            checked += 1
            if verified_unchanged(folder, record, verified):
                reused += 1
                problems += scanned_chunk_problems(read_verified_chunk(path, record.sha256), record, layout, header)
                continue
            total_bytes += path.stat().st_size if path.is_file() else 0
            problems += chunk_problems(path, record, layout, header)
    return CheckOutcome(
        not problems,
        "; ".join(problems[:MAX_LISTED]) or f"{checked} chunks: checksums, shapes and dtypes as recorded",
        {
            "chunks": checked,
            "bytes_read": total_bytes,
            "chunks_verified_by_shard_checks": reused,
            "problems": len(problems),
        },
    )


def check_numerics(drafter_dir: Path) -> CheckOutcome:
    """From the statistics recorded at write time of every chunk the shard checks verified unchanged; other chunks
    are read."""
    manifest = Manifest.read(drafter_dir)
    root = manifest.chunks_dir(drafter_dir)
    stats = LayerStatistics(manifest.layers.stored)
    for shard in manifest.shard_keys:
        folder = root / "hidden_states" / shard
        verified = read_verified(folder)
        for record in read_index(folder):
            if verified_unchanged(folder, record, verified):
                stats.add(folder / record.chunk, record)
            else:
                stats.add_chunk(folder / record.chunk)
    return stats.outcome()


def _small_tensors(path: Path) -> dict:
    """A chunk's ids, masks, offsets and sample ids (memory-mapped reads of those tensors only)."""
    try:
        with safe_open(str(path), framework="np") as chunk:
            return {name: chunk.get_tensor(name) for name in ("input_ids", "loss_mask", "offsets", "sample_ids")}
    except Exception:  # missing or damaged: every sample of it mismatches; the integrity check says why
        return {}


def check_parity(
    drafter_dir: Path,
    tokenized_dir: Path,
    *,
    samples: int,
    seed: int = 0,
    device: str | torch.device = "cpu",
    compute_dtype: torch.dtype | None = None,
    trust_remote_code: bool = False,
) -> CheckOutcome:
    """Re-extract ``samples`` random samples one at a time from their *tokenized* ids (the source of
    truth, not the ids stored beside the states) and compare with what is stored for that sample.

    The reference is the text decoder alone with only the layers the stored ids need (all of them only
    when the final state is stored), found in any wrapper by the same lookup as the extraction's; it
    runs each sample unpadded and reads Hugging Face's ``output_hidden_states``, not the extraction's
    hooks. Its memory is released before this returns."""
    import gc
    import weakref

    from hsx_dagster.core.extraction.backbone import decoder_layers, load_text_decoder
    from hsx_dagster.core.model.info import check_model_dir

    dataset = DrafterDataset(drafter_dir, dtype=torch.float32)
    manifest = dataset.record
    if compute_dtype is None:
        compute_dtype = COMPUTE_DTYPES.get(manifest.compute_dtype, torch.float32)
    tolerance = STORAGE_TOLERANCE[manifest.storage_dtype] + (
        0.0 if compute_dtype == torch.float32 else REDUCED_COMPUTE_TOLERANCE
    )
    picked = sorted(random.Random(seed).sample(range(len(dataset)), min(samples, len(dataset))))
    wanted = {dataset.sample_ids[i] for i in picked}
    tokenized_ids = _tokenized_ids(tokenized_dir, manifest.shard_keys, wanted)
    model_info = check_model_dir(manifest.model_path)
    layers = manifest.layers.stored
    num_layers = manifest.model.get("num_hidden_layers") or model_info.num_hidden_layers
    keep = layers.kept_decoder_layers(num_layers)
    loaded = load_text_decoder(
        model_info, keep, device=device, compute_dtype=compute_dtype, trust_remote_code=trust_remote_code
    )
    model = loaded.model
    # Hugging Face's last hidden state is after the final norm; the raw last kept layer needs a hook.
    last_layer_output: list[torch.Tensor] = []
    hook = None
    if keep - 1 in layers.ids:
        hook = decoder_layers(model)[keep - 1].register_forward_hook(
            lambda module, inputs, output: last_layer_output.append(output[0] if isinstance(output, tuple) else output)
        )
    worst: dict[str, float] = defaultdict(float)
    failing: list[int] = []
    try:
        with torch.inference_mode():
            for index in picked:
                sample = dataset[index]
                source = tokenized_ids.get(sample["sample_id"])
                if source is None or len(source) != len(sample["input_ids"]):
                    failing.append(sample["sample_id"])
                    continue
                last_layer_output.clear()
                input_ids = torch.tensor([source], dtype=torch.int64, device=device)
                outputs = model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
                errors = _relative_errors(sample, outputs, last_layer_output, layers, keep)
                del outputs
                for name, error in errors.items():
                    worst[name] = max(worst[name], error)
                if max(errors.values(), default=0.0) > tolerance:
                    failing.append(sample["sample_id"])
    finally:
        if hook is not None:
            hook.remove()
        still_held = weakref.ref(model)
        del model, loaded
        last_layer_output.clear()
        if still_held() is not None:
            # A reference cycle holds it (the first import of a model class leaves one): a full collection,
            # which takes about a second in a large process, is needed only then.
            gc.collect()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return _parity_outcome(failing, len(picked), tolerance, worst, f"{keep} of {num_layers}")


def _tokenized_ids(tokenized_dir: Path, shard_keys: list[str], wanted: set[int]) -> dict[int, list[int]]:
    """The tokenized ids (the source of truth) of the ``wanted`` samples, by sample id."""
    found: dict[int, list[int]] = {}
    for shard in shard_keys:
        table = read_tokenized_shard(tokenized_dir, shard, columns=["sample_id", "input_ids"])
        for row in table.filter(pc.is_in(table.column("sample_id"), pa.array(sorted(wanted), pa.int64()))).to_pylist():
            found[row["sample_id"]] = row["input_ids"]
    return found


def _relative_errors(
    sample: dict, outputs, last_layer_output: list[torch.Tensor], layers, keep: int
) -> dict[str, float]:
    """Per stored slot (named as the layers' statistics name them), the worst per-token relative error of the
    stored states against the reference forward pass's ``outputs``."""
    references = [(last_layer_output[0] if i == keep - 1 else outputs.hidden_states[i + 1])[0] for i in layers.ids]
    stored = [sample["hidden_states"][:, k] for k in range(len(layers.ids))]
    if layers.include_final:
        references.append(outputs.last_hidden_state[0])
        stored.append(sample["final_hidden_states"])
    errors = {}
    for name, reference, kept in zip(layers.slot_names, references, stored):
        reference = reference.float().cpu()
        error = (kept.float() - reference).norm(dim=-1) / reference.norm(dim=-1).clamp_min(1e-6)
        errors[name] = float(error.max())
    return errors


def _parity_outcome(failing: list[int], checked: int, tolerance: float, worst: dict, loaded: str) -> CheckOutcome:
    description = (
        f"{len(failing)} of {checked} re-extracted samples differ beyond {tolerance:g} relative error: "
        f"{failing[:MAX_LISTED]}"
        if failing
        else f"{checked} random samples re-extracted one at a time match within {tolerance:g}"
    )
    metadata = {
        "samples_checked": checked,
        "tolerance": tolerance,
        "max_relative_error": {k: round(v, 6) for k, v in worst.items()},
        "reference_layers_loaded": loaded,
    }
    return CheckOutcome(not failing, description, metadata)


def check_parity_on_claimed_device(
    drafter_dir: Path,
    tokenized_dir: Path,
    *,
    samples: int,
    seed: int,
    devices: Sequence[str],
    owner: str,
    lock_dir: Path,
    wait_s: float,
    trust_remote_code: bool = False,
    claim: str = "lock",
) -> CheckOutcome:
    """`check_parity` on a device this process claims like a shard run does (one run per GPU; ``claim``:
    extraction.device_claim); with ``samples`` 0 nothing is claimed and no model loads."""
    if samples == 0:
        return CheckOutcome(True, "skipped: drafter.parity_samples is 0 (no device claimed, no model loaded)",
                            {"samples_checked": 0})  # fmt: skip
    with claimed_device(devices, 0, owner=owner, lock_dir=lock_dir, wait_s=wait_s, claim=claim) as device:
        return check_parity(
            drafter_dir,
            tokenized_dir,
            samples=samples,
            seed=seed,
            device=device,
            compute_dtype=None,  # the dtype the shards were computed in, from the manifest
            trust_remote_code=trust_remote_code,
        )
