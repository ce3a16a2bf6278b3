"""Data-quality checks on an assembled drafter dataset, each a plain function returning a `CheckOutcome`.

- coverage: every tokenized sample is in the dataset exactly once, with the same ids and mask;
- integrity: every chunk still has the checksum recorded when it was written; shapes, dtypes and
  layer count match the manifest;
- numerics: no NaN/Inf (fp8 states de-quantised first); per-layer mean/std (a layer of zeros fails;
  an odd scale is reported);
- parity: random samples re-extracted one at a time by an independent reference forward pass
  (`AutoModelForCausalLM`, ``output_hidden_states``) match the stored tensors within the storage
  dtype's tolerance. This is what catches batching, padding and ordering bugs on real runs.

The Dagster asset checks are thin wrappers over these.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from safetensors import safe_open

from hsx_dagster.core.check_outcome import CheckOutcome
from hsx_dagster.core.dataset.reader import DrafterDataset
from hsx_dagster.core.extraction.devices import claimed_device
from hsx_dagster.core.inputs.tokenization import read_tokenized_shard
from hsx_dagster.core.storage.chunk_reader import read_sample
from hsx_dagster.core.storage.format import (
    COMPUTE_DTYPES,
    DRAFTER_INDEX_FILE,
    DRAFTER_QUARANTINE_FILE,
    MANIFEST_FILE,
    SAFETENSORS_DTYPE_NAMES,
    STATE_TENSORS,
    STORAGE_DTYPES,
)
from hsx_dagster.core.storage.quantization import FP8_DTYPE, SCALES_SUFFIX, block_size_for
from hsx_dagster.core.storage.shard_store import StoreError, read_index

# Relative L2 error per token allowed by the storage dtype (its rounding), and added when the
# reference and the batched run compute in a reduced precision (their rounding paths differ).
# fp8 e4m3 with block scales: 2.6% median, 4.0% at most per token on the demo model.
STORAGE_TOLERANCE = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1e-2, "float8_e4m3": 6e-2}
REDUCED_COMPUTE_TOLERANCE = 4e-2
MAX_LISTED = 10


def _manifest(drafter_dir: Path) -> dict:
    return json.loads((drafter_dir / MANIFEST_FILE).read_text(encoding="utf-8"))


def _chunks_root(drafter_dir: Path, manifest: dict) -> Path:
    return (drafter_dir / manifest.get("chunks_root", "..")).resolve()


def check_coverage(drafter_dir: Path, tokenized_dir: Path) -> CheckOutcome:
    manifest = _manifest(drafter_dir)
    root = _chunks_root(drafter_dir, manifest)
    index = pq.read_table(drafter_dir / DRAFTER_INDEX_FILE)
    problems: list[str] = []
    counts = Counter(index.column("sample_id").to_pylist())
    duplicated = sorted(sample_id for sample_id, n in counts.items() if n > 1)
    if duplicated:
        problems.append(f"{len(duplicated)} samples appear more than once (e.g. {duplicated[:MAX_LISTED]})")

    # Samples set aside during extraction (with a reason) are accounted for, not missing.
    quarantine_file = drafter_dir / DRAFTER_QUARANTINE_FILE
    quarantined = (
        set(pq.read_table(quarantine_file).column("sample_id").to_pylist()) if quarantine_file.is_file() else set()
    )
    stored_and_quarantined = sorted(quarantined & set(counts))
    if stored_and_quarantined:
        problems.append(
            f"{len(stored_and_quarantined)} quarantined samples are also stored (e.g. "
            f"{stored_and_quarantined[:MAX_LISTED]})"
        )
    expected_total = 0
    mismatched: list[int] = []
    missing: list[int] = []
    rows_by_chunk: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for row in index.select(["sample_id", "chunk", "position"]).to_pylist():
        rows_by_chunk[row["chunk"]].append((row["sample_id"], row["position"]))
    for shard in [s["shard"] for s in manifest["shards"]]:
        tokenized = read_tokenized_shard(tokenized_dir, shard, columns=["sample_id", "input_ids", "loss_mask"])
        expected_total += tokenized.num_rows
        wanted = {sample_id: row for row, sample_id in enumerate(tokenized.column("sample_id").to_pylist())}
        missing += [sample_id for sample_id in wanted if sample_id not in counts and sample_id not in quarantined]
        for chunk_name in sorted(c for c in rows_by_chunk if f"/{shard}/" in c):
            with safe_open(str(root / chunk_name), framework="pt") as chunk:
                offsets = chunk.get_tensor("offsets").tolist()
                chunk_ids = chunk.get_tensor("sample_ids").tolist()
                ids, masks = chunk.get_tensor("input_ids"), chunk.get_tensor("loss_mask")
            for sample_id, position in rows_by_chunk[chunk_name]:
                row = wanted.get(sample_id)
                start, end = offsets[position], offsets[position + 1]
                if (
                    row is None
                    or chunk_ids[position] != sample_id
                    or ids[start:end].tolist() != tokenized.column("input_ids")[row].as_py()
                    or masks[start:end].tolist() != tokenized.column("loss_mask")[row].as_py()
                ):
                    mismatched.append(sample_id)
    if missing:
        problems.append(f"{len(missing)} tokenized samples are missing (e.g. {sorted(missing)[:MAX_LISTED]})")
    if mismatched:
        problems.append(
            f"{len(mismatched)} samples differ from the tokenized dataset or sit at the wrong place "
            f"(e.g. {sorted(set(mismatched))[:MAX_LISTED]})"
        )
    if index.num_rows - len(duplicated) > expected_total - len(quarantined) and not problems:
        problems.append(f"{index.num_rows} samples in the index for {expected_total} tokenized samples")
    set_aside = f" ({len(quarantined)} more quarantined with a reason)" if quarantined else ""
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
        },
    )


def check_integrity(drafter_dir: Path) -> CheckOutcome:
    manifest = _manifest(drafter_dir)
    root = _chunks_root(drafter_dir, manifest)
    layers = len(manifest["layers"]["ids"])
    storage_dtype = STORAGE_DTYPES[manifest["storage_dtype"]]
    expected_dtype = SAFETENSORS_DTYPE_NAMES[storage_dtype]
    hidden = manifest["hidden_size"]
    scale_columns = hidden // block_size_for(hidden) if storage_dtype == FP8_DTYPE else None
    problems: list[str] = []
    checked = total_bytes = 0
    for shard in [s["shard"] for s in manifest["shards"]]:
        folder = root / "hidden_states" / shard
        try:
            records = read_index(folder)
        except StoreError as exc:  # a garbled index line: the check fails naming it, it does not crash
            problems.append(str(exc))
            continue
        for record in records:
            path = folder / record.chunk
            checked += 1
            if not path.is_file():
                problems.append(f"{path}: missing")
                continue
            digest = hashlib.sha256()
            with open(path, "rb") as handle:
                while block := handle.read(16 * 2**20):
                    digest.update(block)
            total_bytes += path.stat().st_size
            if digest.hexdigest() != record.sha256:
                problems.append(f"{path}: checksum differs from the one recorded at write time (corrupted)")
                continue
            with safe_open(str(path), framework="pt") as chunk:
                names = set(chunk.keys())
                tokens = chunk.get_slice("input_ids").get_shape()[0]
                found = {name: (chunk.get_slice(name).get_dtype(), chunk.get_slice(name).get_shape()) for name in names}
            expected = {"hidden_states": (expected_dtype, [tokens, layers, hidden])}
            if manifest["layers"]["include_final"]:
                expected["final_hidden_states"] = (expected_dtype, [tokens, hidden])
            if scale_columns is not None:
                for name, (_, shape) in list(expected.items()):
                    expected[name + SCALES_SUFFIX] = ("BF16", [*shape[:-1], scale_columns])
            for name, (want_dtype, want_shape) in expected.items():
                got = found.get(name)
                if got is None:
                    problems.append(f"{path}: {name} is missing")
                elif got[0] != want_dtype or list(got[1]) != want_shape:
                    problems.append(
                        f"{path}: {name} is {got[0]} {list(got[1])}, the manifest says {want_dtype} {want_shape}"
                    )
            unexpected = sorted(
                n for n in names if (n.endswith(SCALES_SUFFIX) or n in STATE_TENSORS) and n not in expected
            )
            if unexpected:
                problems.append(f"{path}: {', '.join(unexpected)} present, the manifest disagrees")
    return CheckOutcome(
        not problems,
        "; ".join(problems[:MAX_LISTED]) or f"{checked} chunks: checksums, shapes and dtypes as recorded",
        {"chunks": checked, "bytes_read": total_bytes, "problems": len(problems)},
    )


def check_numerics(drafter_dir: Path) -> CheckOutcome:
    manifest = _manifest(drafter_dir)
    root = _chunks_root(drafter_dir, manifest)
    layer_ids = manifest["layers"]["ids"]
    names = [f"layer {i}" for i in layer_ids] + (["final"] if manifest["layers"]["include_final"] else [])
    sums = np.zeros(len(names))
    squares = np.zeros(len(names))
    nonzero = np.zeros(len(names), dtype=bool)
    count = 0
    bad_samples: list[int] = []
    for shard in [s["shard"] for s in manifest["shards"]]:
        folder = root / "hidden_states" / shard
        for record in read_index(folder):
            with safe_open(str(folder / record.chunk), framework="pt") as chunk:
                offsets = chunk.get_tensor("offsets")
                whole = read_sample(chunk, 0, int(offsets[-1]), dtype=torch.float32)  # fp8 de-quantised
                states = whole["hidden_states"]  # [T, L, H]
                if "final_hidden_states" in whole:
                    states = torch.cat([states, whole["final_hidden_states"].unsqueeze(1)], dim=1)
                sample_ids = chunk.get_tensor("sample_ids").tolist()
            finite = torch.isfinite(states).all(dim=2).all(dim=1)  # per token
            if not bool(finite.all()):
                bad_tokens = torch.nonzero(~finite).flatten()
                owners = torch.searchsorted(offsets, bad_tokens, right=True) - 1
                bad_samples += sorted({sample_ids[int(k)] for k in owners})
                states = torch.where(torch.isfinite(states), states, torch.zeros((), dtype=states.dtype))
            sums += states.sum(dim=(0, 2)).double().numpy()
            squares += (states.double() ** 2).sum(dim=(0, 2)).numpy()
            nonzero |= (states != 0).any(dim=2).any(dim=0).numpy()
            count += states.shape[0] * states.shape[2]
    means = sums / max(count, 1)
    stds = np.sqrt(np.maximum(squares / max(count, 1) - means**2, 0.0))
    problems, warnings = [], []
    if bad_samples:
        problems.append(f"NaN or Inf in {len(bad_samples)} samples: {bad_samples[:MAX_LISTED]}")
    for name, has_values in zip(names, nonzero):
        if not has_values:
            problems.append(f"{name} is all zeros")
    median_std = float(np.median(stds[nonzero])) if nonzero.any() else 0.0
    for name, std in zip(names, stds):
        if median_std > 0 and std > 0 and (std > 100 * median_std or std < median_std / 100):
            warnings.append(f"{name} has std {std:.3g}, far from the median layer's {median_std:.3g}")
    table = {name: {"mean": round(float(m), 6), "std": round(float(s), 6)} for name, m, s in zip(names, means, stds)}
    description = "; ".join(problems + warnings) or "all values finite; per-layer statistics in metadata"
    return CheckOutcome(
        not problems, description, {"per_layer": table, "nonfinite_samples": len(bad_samples), "warnings": warnings}
    )


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
    truth, not the ids stored beside the states) and compare with what is stored for that sample."""
    from transformers import AutoModelForCausalLM

    dataset = DrafterDataset(drafter_dir, dtype=torch.float32)
    manifest = dataset.manifest
    if compute_dtype is None:
        compute_dtype = COMPUTE_DTYPES.get(manifest["compute_dtype"], torch.float32)
    tolerance = STORAGE_TOLERANCE[manifest["storage_dtype"]] + (
        0.0 if compute_dtype == torch.float32 else REDUCED_COMPUTE_TOLERANCE
    )
    picked = sorted(random.Random(seed).sample(range(len(dataset)), min(samples, len(dataset))))
    wanted = {dataset.sample_ids[i] for i in picked}
    tokenized_ids: dict[int, list[int]] = {}
    for shard in [s["shard"] for s in manifest["shards"]]:
        table = read_tokenized_shard(tokenized_dir, shard, columns=["sample_id", "input_ids"])
        for row in table.filter(pc.is_in(table.column("sample_id"), pa.array(sorted(wanted), pa.int64()))).to_pylist():
            tokenized_ids[row["sample_id"]] = row["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(
        manifest["model"]["path"], dtype=compute_dtype, trust_remote_code=trust_remote_code
    )
    model.to(torch.device(device)).eval()  # type: ignore[arg-type]  # transformers types `.to` oddly
    layer_ids = manifest["layers"]["ids"]
    num_layers = model.config.get_text_config().num_hidden_layers
    last_layer_output: list[torch.Tensor] = []
    # Hugging Face's last hidden state is after the final norm; the raw last layer needs a hook.
    hook = None
    if num_layers - 1 in layer_ids:
        hook = model.model.layers[num_layers - 1].register_forward_hook(
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
                outputs = model(input_ids=input_ids, output_hidden_states=True)
                references = {
                    f"layer {i}": (last_layer_output[0] if i == num_layers - 1 else outputs.hidden_states[i + 1])[0]
                    for i in layer_ids
                }
                stored = {f"layer {i}": sample["hidden_states"][:, k] for k, i in enumerate(layer_ids)}
                if "final_hidden_states" in sample:
                    references["final"] = outputs.hidden_states[-1][0]
                    stored["final"] = sample["final_hidden_states"]
                sample_ok = True
                for name, reference in references.items():
                    reference = reference.float().cpu()
                    error = (stored[name].float() - reference).norm(dim=-1) / reference.norm(dim=-1).clamp_min(1e-6)
                    worst[name] = max(worst[name], float(error.max()))
                    sample_ok &= bool(error.max() <= tolerance)
                if not sample_ok:
                    failing.append(sample["sample_id"])
    finally:
        if hook is not None:
            hook.remove()
    description = (
        f"{len(failing)} of {len(picked)} re-extracted samples differ beyond {tolerance:g} relative error: "
        f"{failing[:MAX_LISTED]}"
        if failing
        else f"{len(picked)} random samples re-extracted one at a time match within {tolerance:g}"
    )
    return CheckOutcome(
        not failing,
        description,
        {
            "samples_checked": len(picked),
            "tolerance": tolerance,
            "max_relative_error": {k: round(v, 6) for k, v in worst.items()},
        },
    )


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
) -> CheckOutcome:
    """`check_parity` on a device this process claims like a shard run does (one run per GPU);
    with ``samples`` 0 nothing is claimed and no model loads."""
    if samples == 0:
        return CheckOutcome(True, "skipped: drafter.parity_samples is 0 (no device claimed, no model loaded)",
                            {"samples_checked": 0})  # fmt: skip
    with claimed_device(devices, 0, owner=owner, lock_dir=lock_dir, wait_s=wait_s) as device:
        return check_parity(
            drafter_dir,
            tokenized_dir,
            samples=samples,
            seed=seed,
            device=device,
            compute_dtype=None,  # the dtype the shards were computed in, from the manifest
            trust_remote_code=trust_remote_code,
        )
