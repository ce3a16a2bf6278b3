"""The pipeline's asset keys, declared once; every asset, check, job and sensor names them from here."""

from dagster import AssetKey

CONVERSATIONS = AssetKey("conversations")  # observable source: the files of dataset.paths
TARGET_MODEL = AssetKey("target_model")  # observable source: the directory of model.path
INPUTS = (CONVERSATIONS, TARGET_MODEL)
REGENERATED_CONVERSATIONS = AssetKey("regenerated_conversations")
TOKENIZED_DATASET = AssetKey("tokenized_dataset")
HIDDEN_STATES = AssetKey("hidden_states")
DRAFTER_DATASET = AssetKey("drafter_dataset")
SPECULATORS_DATASET = AssetKey("speculators_dataset")  # output_dir/speculators/: speculators' --data-path
SPECFORGE_DATASET = AssetKey("specforge_dataset")  # output_dir/specforge/: SpecForge's --hidden-states-path
