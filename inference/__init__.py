"""The inference core: GGUF models in NumPy, tokenizers, chat templates, sampling and generation.

Knows nothing of SQLite or Textual, so it can be used as a library on its own. Its names are imported
from their modules when first used: a program that needs one of them (a constant, an error type)
does not load NumPy, numba, Jinja2 and the kernels with it (the command line's `sessions list`).
"""

import importlib
import types

_HOMES = {  # each name the package offers, and its module
    "fit_messages": "prompt",
    "shift_to": "prompt",
    "chat_prompt_ids": "prompt",
    "Alternative": "generate",
    "GenerationStats": "generate",
    "generate": "generate",
    "generate_alternatives": "generate",
    "DEFAULT_MODEL": "catalog",
    "KNOWN_MODELS": "catalog",
    "resolve_model": "catalog",
    "ChatTemplate": "chat_template",
    "BlockPool": "kv_cache",
    "BlockSource": "kv_cache",
    "KVSequence": "kv_cache",
    "ModelConfig": "config",
    "DEFAULT_PREFILL_BATCH": "model",
    "Model": "model",
    "load_model": "model",
    "locate_model": "model",
    "ModelError": "errors",
    "Sampler": "sampling",
    "SamplingParams": "sampling",
    "Tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
}
__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    """The package: `generate` stays the function when its module, of the same name, is imported (the
    import system would set the module in its place)."""

    def __setattr__(self, name: str, value) -> None:
        if not (name in _HOMES and isinstance(value, types.ModuleType)):
            super().__setattr__(name, value)


__import__("sys").modules[__name__].__class__ = _Package
