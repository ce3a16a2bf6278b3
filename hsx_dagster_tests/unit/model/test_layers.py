import pytest

from hsx_dagster.core.model import LayerSpecError, dflash_layers, parse_layer_spec, resolve_layers


def test_eagle3_preset_low_middle_high():
    assert resolve_layers("eagle3", 36) == [1, 17, 32]
    assert resolve_layers("eagle3", 8) == [1, 3, 4]


def test_dflash_preset_matches_design_example():
    assert resolve_layers("dflash-5", 36) == [1, 9, 17, 25, 33]
    assert dflash_layers(1, 36) == [18]
    ids = dflash_layers(4, 28)
    assert ids[0] == 1 and ids[-1] == 25 and ids == sorted(set(ids))


def test_explicit_ids_sorted_and_checked():
    assert resolve_layers([5, 1, 3], 8) == [1, 3, 5]
    with pytest.raises(LayerSpecError, match=r"item \[1\]: layer id 8 is out of range; the model has 8"):
        resolve_layers([1, 8], 8)
    with pytest.raises(LayerSpecError, match="out of range"):
        resolve_layers([-1], 8)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("eagle", "unknown layer preset 'eagle'"),
        ("dflash-0", "unknown layer preset"),
        ([], "empty"),
        ([1, 1], "listed twice"),
        ([1, "2"], "not an integer"),
        ([True], "not an integer"),
    ],
)
def test_bad_specs_are_named(spec, message):
    with pytest.raises(LayerSpecError, match=message):
        parse_layer_spec(spec)


def test_presets_reject_models_too_small():
    with pytest.raises(LayerSpecError, match="at least 6 layers"):
        resolve_layers("eagle3", 4)
    with pytest.raises(LayerSpecError, match="distinct layers"):
        resolve_layers("dflash-9", 8)
