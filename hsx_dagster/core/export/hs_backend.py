"""`hsx`: a hidden-states backend for speculators that serves each row's states straight from our chunks.

Registered in ``hs_connectors``' backend registry (``HiddenStatesBackend.register("hsx")``) when this module is
imported; speculators' trainer then takes ``--hidden-states-backend hsx``. speculators has no plugin discovery, so
``python -m hsx_dagster.core.export.speculators_train`` imports this module and then runs ``speculators`` with the
same arguments. Nothing is copied: row ``r`` of the export's ``datasets`` folder is sample ``sample_id[r]`` of the
drafter dataset, read through the public `DrafterDataset` API (memory-mapped slices; fp8 de-quantised to bf16).

Imports ``hs_connectors``: use it inside speculators' environment only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from hs_connectors import HiddenStatesBackend, HiddenStatesTransfer

from hsx_dagster.core.dataset.reader import DrafterDataset
from hsx_dagster.core.export.mapping import speculators_mapping
from hsx_dagster.core.export.speculators import ARROW_FILE, BACKEND, EXPORT_FILE, row_states


class HsxTransfer(HiddenStatesTransfer):
    """Row ``file_idx`` of an export folder -> ``{"hidden_states": [T, aux + 1, H], "token_ids": [T]}``."""

    def __init__(self, export_dir: Path, dtype: torch.dtype = torch.bfloat16) -> None:
        self.export_dir = Path(export_dir)
        export = json.loads((self.export_dir / EXPORT_FILE).read_text(encoding="utf-8"))
        self.drafter_dir = Path(export["drafter_dataset"])
        self.dtype = dtype
        with pa.memory_map(str(self.export_dir / ARROW_FILE)) as source:
            self.sample_ids = pa.ipc.open_stream(source).read_all().column("sample_id").to_pylist()
        self._dataset: DrafterDataset | None = None

    def setup(self) -> None:
        self._open()

    def _open(self) -> DrafterDataset:
        if self._dataset is None:  # lazily: per DataLoader worker
            self._dataset = DrafterDataset(self.drafter_dir, dtype=self.dtype)
            self._mapping = speculators_mapping(self._dataset.layer_ids, self._dataset.num_hidden_layers)
            self._index_of = {sid: i for i, sid in enumerate(self._dataset.sample_ids)}
        return self._dataset

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor] | None:
        if not 0 <= file_idx < len(self.sample_ids):
            return None
        dataset = self._open()
        sample = dataset[self._index_of[self.sample_ids[file_idx]]]
        return {"hidden_states": row_states(sample, self._mapping), "token_ids": sample["input_ids"]}

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        return None  # an hsx export is complete: there is nothing to generate online


@HiddenStatesBackend.register(BACKEND)
class HsxBackend(HiddenStatesBackend):
    """Serves an hsx export's rows from the drafter dataset it names (``hsx_export.json``)."""

    @staticmethod
    def add_train_args(parser: argparse.ArgumentParser) -> None:
        return None  # everything comes from the export folder (--data-path)

    @staticmethod
    def add_launch_args(parser: argparse.ArgumentParser) -> None:
        return None

    @staticmethod
    def from_train_args(args: argparse.Namespace, data_path: str) -> HiddenStatesTransfer:
        return HsxTransfer(Path(data_path))

    @staticmethod
    def build_kv_transfer_config(args: argparse.Namespace) -> dict[str, Any]:
        raise NotImplementedError("the hsx backend reads states hsx-dagster extracted; it does not launch vLLM")
