"""The assets, one module each: inputs.py (the observable sources `conversations` and `target_model`),
tokenized.py, regenerated.py (optional), hidden_states.py (partitioned by shard), drafter.py and exports.py
(`speculators_dataset`, `specforge_dataset`). Their checks are in defs/checks.py."""
