"""The one way a chat engine is built, by the app, the command line and the server alike: one options
object (each field has its flag), the model loaded with the KV codec's compiled loops made ready, the
store and the remote KV tier opened."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from llama_chat.inference.activation_modes import DEFAULT_ACTIVATIONS
from llama_chat.inference.kv_arena import DEFAULT_CACHE_TYPE, element_type
from llama_chat.inference.kv_cache import DEFAULT_BLOCK_SIZE
from llama_chat.storage.codec import PLANNED_CODECS

from .sessions import Sessions
from .settings import CACHE_RAM_MB, CODEC, DEFAULT_PARALLEL, DEFAULT_QUEUE, N_CTX

if TYPE_CHECKING:
    from llama_chat.inference import Model

    from .engine import ChatEngine

# The model's code (numba's kernels, the tokenizers, the engine) loads where a model is built: the app
# draws its window and chats first, and a command that needs no model never loads it.

Progress = Callable[[str, int, int], None]
IN_MEMORY = ":memory:"  # the database of an engine that keeps nothing (a one-off question)


@dataclass
class EngineOptions:
    """What a chat engine is built from; each has its flag (app/cli.py)."""

    model: str | None = None  # --model: a known model's name or a .gguf path; None: the default model
    db: Path | str = IN_MEMORY  # --db: the conversation database
    sessions: Sessions | None = None  # open conversations to use instead of `db`'s (the app's: shown first)
    n_ctx: int = N_CTX  # --ctx
    cache_ram_mb: float = CACHE_RAM_MB  # --cache-ram
    block_size: int = DEFAULT_BLOCK_SIZE  # --block-size
    cache_type: str = DEFAULT_CACHE_TYPE  # --cache-type: the live KV cache's element type
    activations: str = DEFAULT_ACTIVATIONS  # --activations: what matrix products take their inputs as
    prompt_lookup: bool = True  # --no-lookup
    use_mmap: bool = True  # --no-mmap: the weights read into memory, not mapped from their packed file
    codec: str = CODEC  # --kv-codec: what new KV snapshots are stored in
    kv_remote: str | None = None  # --kv-remote: a Redis/Valkey URL, KV blocks shared with other servers
    kv_secret: str | None = None  # --kv-secret: what signs them there
    kv_fetch: str = "measured"  # --kv-fetch: read missing blocks where faster than computing, or always
    parallel: int = DEFAULT_PARALLEL  # --parallel: replies decoded together
    queue: int = DEFAULT_QUEUE  # --queue: replies waiting beyond those


def load_chat_model(
    name: str | None, progress: Progress | None = None, codec: str = CODEC, **options
) -> Model:
    """load_model (name, progress and its options: what numba compiles for it is shown as it compiles),
    then what no first reply waits on compiled on a thread of its own (compile_later). Under a planned
    `codec` (auto, auto-h), the model's KV plan too (measured at its first use)."""
    from llama_chat.inference import load_model
    from llama_chat.inference.products import compile_one_row_later
    from llama_chat.storage.kv_plan import model_plan

    from .compile_progress import CompileProgress

    compile_one_row_later()
    if progress is None:
        model = load_model(name, **options)
    else:
        with CompileProgress(progress) as told:  # what really compiles, as it does
            model = load_model(name, progress=told, **options)
    compile_later(model)
    if codec in PLANNED_CODECS:
        model_plan(model, progress, codec)
    return model


def compile_later(model: Model) -> threading.Thread:
    """What a first reply does not wait on, compiled (first start: 5-20 s on 2 cores) or loaded from
    numba's cache on a thread of its own while the user reads and types: the products of one row (until
    then a decoded token goes through the passes, with the same bits) and of two rows at once (two
    replies decoded together), the attention kernel of the model's cache type (past
    KERNEL_ATTENTION_FROM cached positions), the KV codec's loops (a reply's snapshot, a resume) and
    what only a prompt past KERNEL_ROWS rows takes (compile_long_prompts). A call that comes first waits
    for numba's compiler lock (or for the crossover's measurement) and runs what it made ready, so a
    reply is the same whichever came first. Not a daemon: a process that ends sooner (a short `ask`)
    waits for it, so what it compiles is cached whole for the next start."""

    from llama_chat.inference.products import compile_later_rows
    from llama_chat.inference.warmup import compile_attention, compile_long_prompts
    from llama_chat.storage.codec import compile_kernels as compile_codec

    def compile_all() -> None:
        try:
            compile_later_rows(model.weights.matrices())
            compile_attention(element_type(model.pool.cache_type))
            compile_codec()
            compile_long_prompts(model.weights.activations)
        except Exception:  # (never seen) the first call compiles it again and says what fails, where
            pass  # it is made: no traceback from a thread no one waits on

    thread = threading.Thread(target=compile_all, name="compile-later")
    thread.start()
    return thread


def open_model(options: EngineOptions, progress: Progress | None = None) -> Model:
    return load_chat_model(
        options.model,
        progress,
        options.codec,
        cache_ram_mb=options.cache_ram_mb,
        block_size=options.block_size,
        cache_type=options.cache_type,
        activations=options.activations,
        prompt_lookup=options.prompt_lookup,
        n_ctx=options.n_ctx,
        use_mmap=options.use_mmap,
    )


def open_remote(options: EngineOptions, fingerprint: str):
    """The remote KV tier of --kv-remote, if one is named (RemoteTierError says what is wrong)."""
    if not options.kv_remote:
        return None
    from llama_chat.storage.remote import RemoteTier  # redis is imported only where a tier is used

    always = options.kv_fetch == "always"
    return RemoteTier.from_url(options.kv_remote, options.kv_secret, fingerprint, always_fetch=always)


def open_engine(
    options: EngineOptions, progress: Progress | None = None, model: Model | None = None
) -> ChatEngine:
    """The chat engine `options` describe: its model loaded (unless `model` is one loaded already from
    them), its conversations (those of `db`, unless the options bring some open) and remote tier
    opened; the conversations hear of it (their forks and deletes go through it). Whoever built it
    closes it (ChatEngine.close), and the conversations it brought in the options; those opened here
    (none brought: a database in memory, say) live as long as the engine."""
    from .engine import ChatEngine
    from .scheduler import Scheduler

    sessions = options.sessions or Sessions(options.db)
    try:
        model = model or open_model(options, progress)
        remote = open_remote(options, model.fingerprint)
        scheduler = Scheduler(model, options.parallel, options.queue)
        engine = ChatEngine(model, sessions.store, options.codec, options.n_ctx, scheduler, remote)
    except BaseException:
        if options.sessions is None:
            sessions.close()
        raise
    sessions.engine = engine
    return engine
