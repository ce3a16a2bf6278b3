import json
from pathlib import Path

import pytest

from hsx_dagster.core.settings import SettingsError, load_settings, reference as settings_reference
from hsx_dagster.core.shard_keys import shard_keys
from hsx_dagster_tests.support.paths import REPO


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A settings folder with two input files and a model directory (config.json + a weights file)."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text('{"messages": []}\n')
    (tmp_path / "in" / "b.json").write_text("[]")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 36}))
    (model / "model.safetensors").write_bytes(b"")
    return tmp_path


def write(project: Path, text: str, name: str = "hsx.yaml") -> Path:
    path = project / name
    path.write_text(text)
    return path


BASE = """
dataset:
  paths: [in/a.jsonl, in/b.json]
model:
  path: model
"""


def test_defaults_and_relative_paths_resolve_against_the_settings_folder(project, monkeypatch, tmp_path):
    monkeypatch.chdir("/")
    settings = load_settings(write(project, BASE))
    assert settings.dataset.paths == [project / "in" / "a.jsonl", project / "in" / "b.json"]
    assert settings.model.path == project / "model"
    assert settings.output_dir == project / "data" / "out"
    assert settings.tokenized_dir == project / "data" / "out" / "tokenized"
    assert settings.layer_ids == [1, 17, 32]
    assert settings.shards == 1 and settings.shard_keys == ["shard-00"]
    assert settings.dataset.thinking == "keep"
    assert settings.dataset.loss_mask == "assistant"


def test_hsx_config_env_var_and_env_overrides(project, monkeypatch):
    path = write(project, BASE + "shards: 3\nextraction:\n  batch_size: 8\n", "other.yaml")
    monkeypatch.setenv("HSX_CONFIG", str(path))
    monkeypatch.setenv("HSX_EXTRACTION__BATCH_SIZE", "64")
    monkeypatch.setenv("HSX_MODEL__LAYERS", "[2, 4, 6]")
    settings = load_settings()
    assert settings.source == path
    assert settings.shards == 3
    assert settings.extraction.batch_size == 64  # the environment wins over the file
    assert settings.layer_ids == [2, 4, 6]
    monkeypatch.setenv("HSX_MODEL__LAYERS", "dflash-5")
    assert load_settings().layer_ids == [1, 9, 17, 25, 33]


@pytest.mark.parametrize(
    "extra, message",
    [
        ("shardz: 2\n", r"key `shardz`: unknown key"),
        ("dataset:\n  paths: [in/a.jsonl]\n  max_lenght: 5\n", r"key `dataset.max_lenght`: unknown key"),
        ("shards: two\n", r"key `shards`: Input should be a valid integer.*'two'"),
        ("shards: 0\n", r"key `shards`: Input should be greater than or equal to 1"),
        ("extraction:\n  batch_size: -1\n", r"key `extraction.batch_size`"),
        ("dataset:\n  paths: [in/a.jsonl]\n  thinking: maybe\n", r"key `dataset.thinking`.*'maybe'"),
        ("dataset:\n  paths: [in/a.jsonl]\n  loss_mask: user\n", r"key `dataset.loss_mask`.*'assistant' or 'all'"),
    ],
)
def test_bad_keys_and_values_are_named(project, extra, message):
    text = BASE + extra
    if extra.startswith("dataset:"):
        text = "model:\n  path: model\n" + extra
    with pytest.raises(SettingsError, match=message):
        load_settings(write(project, text))


def test_missing_required_key(project):
    with pytest.raises(SettingsError, match=r"key `model`: required key is missing"):
        load_settings(write(project, "dataset:\n  paths: [in/a.jsonl]\n"))


def test_missing_input_file_names_the_list_item(project):
    text = BASE.replace("in/b.json", "in/nope.jsonl")
    with pytest.raises(SettingsError, match=r"key `dataset.paths\[1\]`: file not found: .*nope.jsonl"):
        load_settings(write(project, text))


def test_layer_ids_out_of_range_named_before_weights(project):
    with pytest.raises(SettingsError, match=r"key `model.layers`: item \[1\]: layer id 36 is out of range.*36 decoder"):
        load_settings(write(project, BASE + "  layers: [3, 36]\n"))
    with pytest.raises(SettingsError, match=r"key `model.layers`.*unknown layer preset 'eagle-3'"):
        load_settings(write(project, BASE + "  layers: eagle-3\n"))


def test_model_directory_problems(project):
    with pytest.raises(SettingsError, match=r"key `model\.path`: model directory not found"):
        load_settings(write(project, BASE.replace("path: model", "path: missing")))
    (project / "model" / "model.safetensors").unlink()
    with pytest.raises(SettingsError, match=r"key `model\.path`: .* holds no weights"):
        load_settings(write(project, BASE))


def test_yaml_syntax_error_names_line(project):
    with pytest.raises(SettingsError, match=r"hsx.yaml: line 4, column 4 is not valid YAML"):
        load_settings(write(project, "shards: 1\ndataset:\n  paths: [a\n  b: ]\n"))


def test_missing_settings_file(tmp_path):
    with pytest.raises(SettingsError, match="settings file not found"):
        load_settings(tmp_path / "nope.yaml")


def test_shard_keys_widen_past_100():
    assert shard_keys(3) == ["shard-00", "shard-01", "shard-02"]
    assert shard_keys(101)[-1] == "shard-100"
    assert shard_keys(100)[-1] == "shard-99"


def test_the_retry_interval_is_checked_and_the_old_cron_key_named(project):
    with pytest.raises(SettingsError, match=r"key `operations.retry_cron`: replaced by `operations.retry_every_s`"):
        load_settings(write(project, BASE + "operations:\n  retry_cron: '*/15 * * * *'\n"))
    with pytest.raises(SettingsError, match=r"key `operations.retry_every_s`: .*greater than or equal to 30"):
        load_settings(write(project, BASE + "operations:\n  retry_every_s: 5\n"))
    assert load_settings(write(project, BASE + "operations:\n  retry_every_s: 3600\n")).operations.retry_every_s == 3600


def test_the_reference_table_in_the_docs_is_generated_from_the_declarations():
    """Each setting is declared once (type, default, description); docs/configuration.md shows that declaration."""
    text = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert settings_reference.with_table(text) == text, (
        "docs/configuration.md's settings table differs from hsx_dagster/core/settings/schema.py: "
        f"run `{settings_reference.COMMAND}`"
    )
    keys = [key for key, _, _ in settings_reference.rows()]
    assert "extraction.batch_size" in keys and "regenerate.retry_failed" in keys and "extraction" not in keys
    assert all(meaning for _, _, meaning in settings_reference.rows())  # every key says what it means
