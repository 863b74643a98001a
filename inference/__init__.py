"""The inference core: GGUF models in NumPy, tokenizers, chat templates, sampling and generation.

Knows nothing of SQLite or Textual, so it can be used as a library on its own.
"""

from .catalog import DEFAULT_MODEL, KNOWN_MODELS, resolve_model
from .chat_template import ChatTemplate
from .config import ModelConfig
from .errors import ModelError
from .generate import Alternative, GenerationStats, generate, generate_alternatives
from .kv_cache import BlockPool, BlockSource, KVSequence
from .model import DEFAULT_PREFILL_BATCH, Model, load_model
from .prompt import chat_prompt_ids, fit_messages, shift_to
from .sampling import Sampler, SamplingParams
from .tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "fit_messages",
    "shift_to",
    "Alternative",
    "generate_alternatives",
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "ChatTemplate",
    "GenerationStats",
    "BlockPool",
    "BlockSource",
    "ModelConfig",
    "DEFAULT_PREFILL_BATCH",
    "KVSequence",
    "Model",
    "ModelError",
    "Sampler",
    "SamplingParams",
    "Tokenizer",
    "chat_prompt_ids",
    "generate",
    "load_model",
    "load_tokenizer",
    "resolve_model",
]
