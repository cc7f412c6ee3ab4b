"""The one error type for user mistakes in a config, shared by every layer that validates."""


class ConfigError(ValueError):
    """A user error in the config: `key` is the dotted key, `message` says what is allowed."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message
