"""The project's error types: every failure a user can cause names its cause."""


class SRMError(Exception):
    """Base class of every error srm-max raises on bad input."""


class CheckpointError(SRMError, ValueError):
    """A checkpoint, config or weight file is missing, malformed or inconsistent."""


class ConvertError(SRMError, ValueError):
    """A source checkpoint cannot be converted (unknown keys, bad shapes, parity failure)."""


class GenerationError(SRMError, ValueError):
    """A generation request is invalid (bad prompt, token id, sampling parameter, device)."""


class ContextLengthError(GenerationError):
    """A prompt does not fit the model's context length (the server's ``context_length_exceeded``)."""
