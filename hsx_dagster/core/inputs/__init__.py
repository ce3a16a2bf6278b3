"""Inputs: conversation files -> chat-template rendering with loss masks -> token ids, balanced into shards."""
