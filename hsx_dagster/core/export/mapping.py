"""The layer mapping between our stored layers and what each trainer reads, decided before anything is written.

Our id ``i`` is the output of decoder layer ``i`` (Hugging Face ``hidden_states[i + 1]``).
- speculators (vLLM's numbering): its id ``k`` is the *input* of decoder layer ``k``, so ``k = i + 1``; its last
  slot (``verifier_last_hidden_states``) is id ``N``, the raw output of the last decoder layer (our ``N - 1``), to
  which it applies the verifier's final norm and LM head itself.
- SpecForge EAGLE-3 (SGLang's capture): its ids are ours; ``hidden_state`` is what the LM head reads (the final
  norm's output: our ``final_hidden_states``, ``model.include_final``).
- SpecForge DFlash (z-lab's ``target_layer_ids``): its ids are ours; ``hidden_states`` is their concatenation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class ExportError(ValueError):
    """The dataset cannot serve the trainer as asked; the message names the setting to change."""


@dataclass(frozen=True)
class LayerMapping:
    """Which positions of our ``hidden_states`` L axis feed the trainer, in the order it reads them."""

    trainer: str
    num_hidden_layers: int
    aux_ids: tuple[int, ...]  # our ids of the auxiliary layers, in the trainer's order
    aux_positions: tuple[int, ...]  # their places on our L axis
    trainer_aux_ids: tuple[int, ...]  # the same layers in the trainer's numbering
    last: str  # what the trainer's last/target slot is: "layer N-1 (raw)", "final norm output" or "none"
    last_position: int | None  # place of the last slot on our L axis; None when it is the final state or absent

    def table(self) -> list[dict[str, Any]]:
        """One row per slot: the trainer's slot, its id for the layer, our id, what the tensor is."""
        rows = [
            {"slot": f"aux[{n}]", "trainer_id": theirs, "our_id": ours, "tensor": f"output of decoder layer {ours}"}
            for n, (ours, theirs) in enumerate(zip(self.aux_ids, self.trainer_aux_ids, strict=True))
        ]
        n = self.num_hidden_layers
        if self.last == "raw":
            rows.append(
                {"slot": "last", "trainer_id": n, "our_id": n - 1, "tensor": f"raw output of decoder layer {n - 1}"}
            )
        elif self.last == "final":
            rows.append({"slot": "hidden_state", "trainer_id": None, "our_id": "final", "tensor": "final norm output"})
        return rows

    def markdown(self) -> str:
        lines = ["| slot | trainer's id | our id | tensor |", "|---|---:|---:|---|"]
        for row in self.table():
            theirs = "" if row["trainer_id"] is None else row["trainer_id"]
            lines.append(f"| {row['slot']} | {theirs} | {row['our_id']} | {row['tensor']} |")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "trainer": self.trainer,
            "convention": "our id i = output of decoder layer i = Hugging Face hidden_states[i + 1]",
            "num_hidden_layers": self.num_hidden_layers,
            "aux_ids": list(self.aux_ids),
            "trainer_aux_ids": list(self.trainer_aux_ids),
            "last": self.last,
            "slots": self.table(),
        }


def _need_layers(num_hidden_layers: int | None) -> int:
    if not num_hidden_layers:
        raise ExportError("the manifest does not record the model's num_hidden_layers; assemble drafter_dataset again")
    return num_hidden_layers


def speculators_mapping(
    layer_ids: list[int], num_hidden_layers: int | None, *, aux_layers: int | None = None
) -> LayerMapping:
    """speculators' auxiliary layers (every stored layer but the last decoder layer's) and its last slot."""
    n = _need_layers(num_hidden_layers)
    if n - 1 not in layer_ids:
        raise ExportError(
            f"speculators' last slot is the raw output of the last decoder layer (our id {n - 1}), which was not "
            f"stored (model.layers gave {layer_ids}): add {n - 1} to model.layers, or set model.layers: speculators "
            "(what speculators' own data generation captures), and extract again"
        )
    aux = [layer for layer in layer_ids if layer != n - 1]
    if not aux:
        raise ExportError(f"model.layers stores only layer {n - 1}: speculators needs auxiliary layers too")
    if aux_layers is not None and aux_layers > len(aux):
        raise ExportError(
            f"the draft config asks for {aux_layers} auxiliary layers but the dataset stores {len(aux)} ({aux}) "
            "besides the last layer: add layers to model.layers (e.g. model.layers: speculators) and extract again"
        )
    if aux_layers is not None:
        aux = aux[:aux_layers]
    return LayerMapping(
        trainer="speculators",
        num_hidden_layers=n,
        aux_ids=tuple(aux),
        aux_positions=tuple(layer_ids.index(layer) for layer in aux),
        trainer_aux_ids=tuple(layer + 1 for layer in aux),
        last="raw",
        last_position=layer_ids.index(n - 1),
    )


def specforge_mapping(
    layer_ids: list[int], num_hidden_layers: int | None, include_final: bool, layout: str
) -> LayerMapping:
    """SpecForge's EAGLE-3 (three auxiliary layers + the final norm's output) or DFlash (every stored layer)."""
    n = _need_layers(num_hidden_layers)
    if layout == "dflash":
        return LayerMapping("specforge-dflash", n, tuple(layer_ids), tuple(range(len(layer_ids))), tuple(layer_ids),
                            "none", None)  # fmt: skip
    if layout != "eagle3":
        raise ExportError(f"export.specforge_layout is {layout!r}; use eagle3 or dflash")
    if not include_final:
        raise ExportError(
            "SpecForge's EAGLE-3 `hidden_state` is what the LM head reads (the final norm's output), which was not "
            "stored: set model.include_final: true and extract again"
        )
    aux = [layer for layer in layer_ids if layer != n - 1] if len(layer_ids) > 3 else list(layer_ids)
    if len(aux) != 3:
        raise ExportError(
            f"SpecForge's EAGLE-3 reads exactly three auxiliary layers; model.layers stores {layer_ids}: set "
            "model.layers: eagle3 (or speculators) and extract again"
        )
    return LayerMapping("specforge-eagle3", n, tuple(aux), tuple(layer_ids.index(layer) for layer in aux),
                        tuple(aux), "final", None)  # fmt: skip
