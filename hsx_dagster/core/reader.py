"""`DrafterDataset`: what a drafter trainer opens.

    from hsx_dagster import DrafterDataset, collate_drafter_batch
    ds = DrafterDataset("data/out/drafter", split="train")
    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=4, collate_fn=collate_drafter_batch)

Reads are memory-mapped slices of the safetensors chunks (a sample never loads its whole chunk),
open files are per process (safe with DataLoader workers, forked or spawned), and nothing on the
read path unpickles: the index is Parquet, the manifest JSON, the tensors safetensors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from safetensors import SafetensorError, safe_open

from hsx_dagster.core.drafter import INDEX_FILE, MANIFEST_FILE


class DatasetError(RuntimeError):
    """The dataset on disk is missing, unreadable or inconsistent; the message names the file."""


class DrafterDataset(torch.utils.data.Dataset):
    """Samples of an assembled drafter dataset, ordered by sample id; ``split`` is 'train', 'val' or None."""

    def __init__(self, path: str | os.PathLike[str], split: str | None = None) -> None:
        self.path = Path(path)
        manifest_file = self.path / MANIFEST_FILE
        if not manifest_file.is_file():
            raise DatasetError(f"{manifest_file} not found: is {self.path} an assembled drafter dataset?")
        self.manifest = json.loads(manifest_file.read_text(encoding="utf-8"))
        if split not in (None, "train", "val"):
            raise ValueError(f"split must be 'train', 'val' or None, not {split!r}")
        table = pq.read_table(self.path / self.manifest.get("index", INDEX_FILE))
        if split is not None:
            table = table.filter(pc.equal(table.column("split"), split))
        self.split = split
        self._root = (self.path / self.manifest.get("chunks_root", "..")).resolve()
        self._sample_ids = table.column("sample_id").to_pylist()
        self._chunks = table.column("chunk").to_pylist()
        self._positions = table.column("position").to_pylist()
        self._num_tokens = table.column("num_tokens").to_pylist()
        self._has_final = bool(self.manifest["layers"]["include_final"])
        self._open: dict[str, tuple[object, list[int]]] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self._sample_ids)

    @property
    def sample_ids(self) -> list[int]:
        return list(self._sample_ids)

    @property
    def num_tokens(self) -> list[int]:
        """Token count per sample (for length-grouped samplers), without reading any tensor."""
        return list(self._num_tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor | int]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        chunk_name, position = self._chunks[index], self._positions[index]
        chunk, offsets = self._chunk(chunk_name)
        start, end = offsets[position], offsets[position + 1]
        try:
            sample = {
                "sample_id": self._sample_ids[index],
                "input_ids": chunk.get_slice("input_ids")[start:end].to(torch.int64),
                "loss_mask": chunk.get_slice("loss_mask")[start:end],
                "hidden_states": chunk.get_slice("hidden_states")[start:end],
            }
            if self._has_final:
                sample["final_hidden_states"] = chunk.get_slice("final_hidden_states")[start:end]
        except (SafetensorError, RuntimeError, ValueError) as exc:
            raise DatasetError(f"{self._root / chunk_name}: cannot read sample {self._sample_ids[index]}: {exc}") from None
        return sample

    def _chunk(self, name: str):
        if os.getpid() != self._pid:  # a forked DataLoader worker: never share the parent's open files
            self._open, self._pid = {}, os.getpid()
        if name not in self._open:
            path = self._root / name
            try:
                handle = safe_open(str(path), framework="pt")
                offsets = handle.get_tensor("offsets").tolist()
            except FileNotFoundError:
                raise DatasetError(f"{path}: chunk file is missing") from None
            except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
                raise DatasetError(f"{path}: not a readable safetensors chunk (truncated or corrupted?): {exc}") from None
            self._open[name] = (handle, offsets)
        return self._open[name]

    def __getstate__(self) -> dict:
        # Spawned DataLoader workers receive the dataset by pickling the Dataset object itself (the
        # data files are never pickled); open file handles stay behind.
        state = dict(self.__dict__)
        state["_open"] = {}
        return state


def collate_drafter_batch(samples: list[dict], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad a list of samples into a batch, with an attention mask (1 on real tokens)."""
    longest = max(len(s["input_ids"]) for s in samples)
    count = len(samples)
    first = samples[0]
    batch = {
        "sample_id": torch.tensor([s["sample_id"] for s in samples], dtype=torch.int64),
        "input_ids": torch.full((count, longest), pad_token_id, dtype=torch.int64),
        "loss_mask": torch.zeros((count, longest), dtype=first["loss_mask"].dtype),
        "attention_mask": torch.zeros((count, longest), dtype=torch.int64),
        "hidden_states": torch.zeros((count, longest, *first["hidden_states"].shape[1:]), dtype=first["hidden_states"].dtype),
    }
    if "final_hidden_states" in first:
        batch["final_hidden_states"] = torch.zeros((count, longest, first["final_hidden_states"].shape[-1]), dtype=first["final_hidden_states"].dtype)
    for row, sample in enumerate(samples):
        length = len(sample["input_ids"])
        batch["input_ids"][row, :length] = sample["input_ids"]
        batch["loss_mask"][row, :length] = sample["loss_mask"]
        batch["attention_mask"][row, :length] = 1
        batch["hidden_states"][row, :length] = sample["hidden_states"]
        if "final_hidden_states" in batch:
            batch["final_hidden_states"][row, :length] = sample["final_hidden_states"]
    return batch
