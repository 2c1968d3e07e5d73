"""Project exceptions: user mistakes raise these with a message a user can act on."""


class SeerError(Exception):
    """A user-facing error (bad input, bad config, missing file)."""


class ConfigError(SeerError, ValueError):
    """A configuration value is invalid; the message names the key, the value and what is allowed."""


class InputError(SeerError, ValueError):
    """A request or prompt is invalid."""
