"""srm-max: Structured Recurrent Mixers on MAX."""

__version__ = "0.1.0"

from .models.srm.config import SRMConfig  # noqa: E402
from .errors import CheckpointError, ConvertError, GenerationError, SRMError  # noqa: E402

__all__ = ["Generator", "SRMConfig", "SRMError", "CheckpointError", "ConvertError", "GenerationError"]


def __getattr__(name: str):
    # The Generator pulls in MAX, a slow import: load it on first use only.
    if name == "Generator":
        from .serve.generator import Generator

        return Generator
    raise AttributeError(f"module 'srm_max' has no attribute {name!r}")
