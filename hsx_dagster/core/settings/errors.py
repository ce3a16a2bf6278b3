"""The settings' one error type, in a module of its own so the light modules that raise it (shard keys) need no
pydantic."""


class SettingsError(ValueError):
    """A settings problem, worded for the user: file, key, bad value, what is expected."""
