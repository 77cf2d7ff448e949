"""srm-max: Structured Recurrent Mixers on MAX."""

from .config import SRMConfig
from .errors import CheckpointError, ConvertError, GenerationError, SRMError

__all__ = ["SRMConfig", "SRMError", "CheckpointError", "ConvertError", "GenerationError"]
