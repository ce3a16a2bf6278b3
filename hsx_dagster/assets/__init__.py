"""The Dagster assets, one module each: tokenized_dataset, hidden_states, drafter_dataset."""
