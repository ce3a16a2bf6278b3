"""Which decoder layers to capture, and the one numbering convention used everywhere.

Layer id ``i`` is the output of decoder layer ``i`` (0-based), which Hugging Face returns as
``hidden_states[i + 1]`` (``hidden_states[0]`` is the embedding output). Tools disagree on this by
one; the manifest records the convention so a trainer never has to guess.

Presets:
- ``eagle3``: ``[1, N // 2 - 1, N - 4]`` (low, middle and high features, as EAGLE-3 uses them);
- ``dflash-K``: ``K`` ids evenly spaced over ``[1, N - 3]`` (N = 36, K = 5 gives 1, 9, 17, 25, 33);
- ``speculators``: what speculators' own data generation captures for the model: its default auxiliary layers
  ``[2, N // 2, N - 3]`` in vLLM's numbering (the *input* of decoder layer k, so our id k - 1) plus the raw output of
  the last decoder layer (its last slot), i.e. ``[1, N // 2 - 1, N - 4, N - 1]`` here (docs/trainers-speculators.md).
"""

from __future__ import annotations

import re

LAYER_CONVENTION = "id i = output of decoder layer i (0-based) = Hugging Face hidden_states[i + 1]"
_DFLASH = re.compile(r"dflash-(\d+)")


class LayerSpecError(ValueError):
    """A layer specification that cannot be used with the model."""


def parse_layer_spec(spec: list[int] | str) -> list[int] | tuple[str, int]:
    """Check the form of a spec without knowing the model: a list of ids, 'eagle3' or 'dflash-K'."""
    if isinstance(spec, str):
        if spec == "eagle3":
            return ("eagle3", 3)
        if spec == "speculators":
            return ("speculators", 4)
        match = _DFLASH.fullmatch(spec)
        if match and int(match.group(1)) >= 1:
            return ("dflash", int(match.group(1)))
        raise LayerSpecError(
            f"unknown layer preset {spec!r}; use a list of ids, 'eagle3', 'speculators' or 'dflash-K' (K >= 1)"
        )
    if not spec:
        raise LayerSpecError("the list of layer ids is empty")
    seen: set[int] = set()
    for position, layer in enumerate(spec):
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise LayerSpecError(f"item [{position}] is {layer!r}, not an integer layer id")
        if layer in seen:
            raise LayerSpecError(f"item [{position}]: layer id {layer} is listed twice")
        seen.add(layer)
    return list(spec)


def resolve_layers(spec: list[int] | str, num_layers: int) -> list[int]:
    """The sorted layer ids a spec means for a model with ``num_layers`` decoder layers."""
    parsed = parse_layer_spec(spec)
    if isinstance(parsed, list):
        for position, layer in enumerate(parsed):
            if not 0 <= layer < num_layers:
                raise LayerSpecError(
                    f"item [{position}]: layer id {layer} is out of range; the model has {num_layers} "
                    f"decoder layers, so ids run from 0 to {num_layers - 1}"
                )
        return sorted(parsed)
    name, count = parsed
    if name == "eagle3":
        if num_layers < 6:
            raise LayerSpecError(f"'eagle3' needs a model with at least 6 layers; this one has {num_layers}")
        return sorted({1, num_layers // 2 - 1, num_layers - 4})
    if name == "speculators":
        if num_layers < 6:
            raise LayerSpecError(f"'speculators' needs a model with at least 6 layers; this one has {num_layers}")
        return sorted({1, num_layers // 2 - 1, num_layers - 4, num_layers - 1})
    return dflash_layers(count, num_layers)


def dflash_layers(count: int, num_layers: int) -> list[int]:
    """``count`` ids evenly spaced over [1, num_layers - 3], rounded to the nearest layer."""
    if num_layers < 4:
        raise LayerSpecError(f"'dflash-{count}' needs a model with at least 4 layers; this one has {num_layers}")
    if count == 1:
        return [num_layers // 2]
    first, last = 1, num_layers - 3
    if count > last - first + 1:
        raise LayerSpecError(
            f"'dflash-{count}' asks for {count} distinct layers but only {last - first + 1} lie in [1, {last}]"
        )
    step = (last - first) / (count - 1)
    return [int(first + index * step + 0.5) for index in range(count)]
