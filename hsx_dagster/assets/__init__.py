"""The Dagster assets, one module each: tokenized_dataset, hidden_states, drafter_dataset; beside them
inputs.py (the observable sources conversations and target_model) and shard_checks.py (the blocking
checks on each hidden_states partition)."""
