"""`DrafterDataset`: what a drafter trainer opens.

    from hsx_dagster import DrafterDataset, collate_drafter_batch
    ds = DrafterDataset("data/out/drafter", split="train")
    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=4, collate_fn=collate_drafter_batch)

Reads are memory-mapped slices of the safetensors chunks (a sample never loads its whole chunk),
open files are per process (safe with DataLoader workers, forked or spawned), and nothing on the
read path unpickles: the index is Parquet, the manifest JSON, the tensors safetensors.

The index is held in numpy arrays (sample ids, chunk codes, positions, token counts; the chunk names once
each), not Python objects: about 21 bytes per sample, and a forked worker reading it writes to none of its
pages (Python objects would be copied page by page as their reference counts change).

fp8 datasets (``storage_dtype: float8_e4m3``) come back de-quantised, in bfloat16 unless ``dtype``
says otherwise; ``raw=True`` hands out the fp8 states and their ``*_scales`` as stored, for
trainers that de-quantise on their own GPU (layout in ``manifest["quantization"]``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from safetensors import SafetensorError, safe_open

from hsx_dagster.core.dataset.manifest import Manifest
from hsx_dagster.core.storage.chunk_reader import read_sample
from hsx_dagster.core.storage.format import MANIFEST_FILE, FormatError, check_drafter_manifest


class DatasetError(RuntimeError):
    """The dataset on disk is missing, unreadable or inconsistent; the message names the file."""


class DrafterDataset(torch.utils.data.Dataset):
    """Samples of an assembled drafter dataset, ordered by sample id; ``split`` is 'train', 'val' or None.

    ``dtype`` casts (or de-quantises) the states; None keeps the stored dtype (bfloat16 for fp8).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        split: str | None = None,
        *,
        dtype: torch.dtype | None = None,
        raw: bool = False,
    ) -> None:
        self.path = Path(path)
        manifest_file = self.path / MANIFEST_FILE
        if not manifest_file.is_file():
            raise DatasetError(f"{manifest_file} not found: is {self.path} an assembled drafter dataset?")
        try:
            # the parsed manifest.json (what trainers read), and the same as a typed record
            self.manifest = check_drafter_manifest(json.loads(manifest_file.read_text(encoding="utf-8")), manifest_file)
            self.record = Manifest.from_dict(self.manifest)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{manifest_file}: not valid JSON ({exc})") from None
        except FormatError as exc:
            raise DatasetError(str(exc)) from None
        except (KeyError, TypeError, ValueError) as exc:
            raise DatasetError(f"{manifest_file}: not a complete manifest (missing or unreadable {exc})") from None
        if split not in (None, "train", "val"):
            raise ValueError(f"split must be 'train', 'val' or None, not {split!r}")
        # the chunk column as Parquet stores it, dictionary-encoded: its strings are never materialized per row
        table = pq.read_table(self.path / self.record.index, read_dictionary=["chunk"])
        if split is not None:
            table = table.filter(pc.equal(table.column("split"), split))
        self.split = split
        self.dtype = dtype
        self.raw = raw
        self._root = self.record.chunks_dir(self.path)
        self._sample_ids = _array(table, "sample_id", np.int64)
        column = table.column("chunk")
        if not pa.types.is_dictionary(column.type):
            column = pc.dictionary_encode(column)
        chunks = column.unify_dictionaries().combine_chunks()
        self._chunk_names: list[str] = chunks.dictionary.to_pylist()  # each chunk's name once
        self._chunk_codes = chunks.indices.to_numpy(zero_copy_only=False).astype(np.int32)
        self._positions = _array(table, "position", np.int32)
        self._num_tokens = _array(table, "num_tokens", np.int32)
        self._open: dict[str, tuple[object, np.ndarray, np.ndarray]] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self._sample_ids)

    @property
    def sample_ids(self) -> list[int]:
        return self._sample_ids.tolist()

    @property
    def sample_ids_array(self) -> np.ndarray:
        """The sample ids as a read-only numpy array, ascending (no copy): for index lookups over 10^6 samples
        without a Python object per sample."""
        view = self._sample_ids.view()
        view.flags.writeable = False
        return view

    @property
    def model(self) -> dict[str, Any]:
        """The target's text model as the manifest records it: ``num_hidden_layers``, ``hidden_size``,
        ``architecture`` (the release's, e.g. Qwen3_5ForConditionalGeneration), ``model_type``,
        ``text_model_type``, plus ``path`` and the hashes of its config, weights index and tokenizer."""
        return dict(self.record.model)

    @property
    def num_hidden_layers(self) -> int | None:
        """Decoder layers of the target's text model: the N the layer presets were resolved with."""
        return self.record.model.get("num_hidden_layers")

    @property
    def hidden_size(self) -> int:
        return self.record.hidden_size

    @property
    def architecture(self) -> str | None:
        return self.record.model.get("architecture")

    @property
    def layer_ids(self) -> list[int]:
        """Stored layer ids, in the order of the L axis of ``hidden_states`` (id i = output of decoder layer i)."""
        return list(self.record.layers.ids)

    @property
    def layer_preset(self) -> str | None:
        """The preset the ids were resolved from (``eagle3``, ``dflash-K``), None for an explicit list."""
        return self.record.layers.preset

    @property
    def num_tokens(self) -> list[int]:
        """Token count per sample (for length-grouped samplers), without reading any tensor."""
        return self._num_tokens.tolist()

    @property
    def num_tokens_array(self) -> np.ndarray:
        """The same as a read-only numpy array (no copy)."""
        view = self._num_tokens.view()
        view.flags.writeable = False
        return view

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        chunk_name, position, sample_id = self.locate(index)
        chunk, offsets, chunk_ids = self._chunk(chunk_name)
        if position >= len(chunk_ids) or chunk_ids[position] != sample_id:
            raise DatasetError(
                f"{self._root / chunk_name}: position {position} does not hold sample {sample_id}: the "
                "chunk was replaced after assembly or the index is stale; assemble the drafter dataset again"
            )
        start, end = int(offsets[position]), int(offsets[position + 1])
        try:
            sample = {"sample_id": sample_id, **read_sample(chunk, start, end, dtype=self.dtype, raw=self.raw)}
        except (SafetensorError, RuntimeError, ValueError) as exc:
            raise DatasetError(f"{self._root / chunk_name}: cannot read sample {sample_id}: {exc}") from None
        return sample

    def locate(self, index: int) -> tuple[str, int, int]:
        """Where sample ``index`` is, from the index alone: (chunk path relative to the chunks root, position in
        the chunk, sample id)."""
        return self._chunk_names[self._chunk_codes[index]], int(self._positions[index]), int(self._sample_ids[index])

    def _chunk(self, name: str):
        if os.getpid() != self._pid:  # a forked DataLoader worker: never share the parent's open files
            self._open, self._pid = {}, os.getpid()
        if name not in self._open:
            if Path(name).is_absolute() or ".." in Path(name).parts:  # the index names files under the dataset only
                raise DatasetError(f"{self.path / self.record.index}: chunk path {name!r} leaves the dataset")
            path = self._root / name
            try:
                handle = safe_open(str(path), framework="pt")
                offsets = handle.get_tensor("offsets").numpy()
                sample_ids = handle.get_tensor("sample_ids").numpy()
            except FileNotFoundError:
                raise DatasetError(f"{path}: chunk file is missing") from None
            except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
                raise DatasetError(
                    f"{path}: not a readable safetensors chunk (truncated or corrupted?): {exc}"
                ) from None
            self._open[name] = (handle, offsets, sample_ids)
        return self._open[name]

    def close(self) -> None:
        """Let go of the chunks opened so far (each is memory-mapped: the pages a long pass read stay counted in the
        process's resident memory until it lets go); the next read opens what it needs again."""
        self._open = {}

    def __getstate__(self) -> dict:
        # Spawned DataLoader workers receive the dataset by pickling the Dataset object itself (the
        # data files are never pickled); open file handles stay behind.
        state = dict(self.__dict__)
        state["_open"] = {}
        return state


def _array(table, column: str, dtype) -> np.ndarray:
    return table.column(column).combine_chunks().to_numpy(zero_copy_only=False).astype(dtype, copy=False)


def collate_drafter_batch(samples: list[dict], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad a list of samples into a batch, with an attention mask (1 on real tokens).

    Every per-token tensor (ids, mask, states, fp8 scales when read raw) is padded alike.
    """
    longest = max(len(s["input_ids"]) for s in samples)
    count = len(samples)
    per_token = [name for name, value in samples[0].items() if isinstance(value, torch.Tensor)]
    batch = {"sample_id": torch.tensor([s["sample_id"] for s in samples], dtype=torch.int64)}
    for name in per_token:
        first = samples[0][name]
        fill = pad_token_id if name == "input_ids" else 0
        batch[name] = torch.full((count, longest, *first.shape[1:]), fill, dtype=first.dtype)
    batch["attention_mask"] = torch.zeros((count, longest), dtype=torch.int64)
    for row, sample in enumerate(samples):
        length = len(sample["input_ids"])
        for name in per_token:
            batch[name][row, :length] = sample[name]
        batch["attention_mask"][row, :length] = 1
    return batch
