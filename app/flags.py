"""The command line's flags as the options of the chat engine they set (chat.build.EngineOptions)."""

from __future__ import annotations

from dataclasses import fields

from .chat.build import EngineOptions

# EngineOptions' field → the argparse dest of its flag, where the names differ
FLAG_OF = {"n_ctx": "ctx", "cache_ram_mb": "cache_ram", "codec": "kv_codec"}


def engine_options(args, **given) -> EngineOptions:
    """The engine's options from the flags on this command line (one a command does not take keeps
    its default), then `given` over them."""
    options = {}
    for field in fields(EngineOptions):
        value = getattr(args, FLAG_OF.get(field.name, field.name), None)
        if value is not None:
            options[field.name] = value
    if getattr(args, "no_lookup", False):
        options["prompt_lookup"] = False
    if getattr(args, "no_mmap", False):
        options["use_mmap"] = False
    return EngineOptions(**{**options, **given})
