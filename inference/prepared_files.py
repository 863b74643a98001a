"""What the cache keeps beside the models (`prepared/`), and which of it no start here reads again:
`llama-chat models --prune` lists those, with their sizes, and removes them.

A start reads, for its GGUF, a metadata entry (`prepared/<key>/`, keyed by the file's path, size and
mtime, a catalog model's by its sha256; weights.py) and a packed file
(`prepared/<path digest>-<profile>.packed`, one per GGUF and machine profile; packed_file.py). A packed
file is stale when it was packed for another machine profile or layout, when its GGUF is gone or changed
since (a catalog model's: when the catalog names another sha256), or when it is not whole; a metadata
entry when it belongs to no model still here — the catalog's models and the GGUFs the packed files name.
A catalog model's assembled GGUF is not read either once its packed file holds all a start reads (one
asked for itself, catalog.resolve_model, stays until then). A start rebuilds whatever it misses (a
catalog model from its pip packages), so removing is only ever slower once, never wrong.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from . import packed_file
from .catalog import KNOWN_MODELS, assembled_model_at, cache_dir, has_packages, model_path, remove_assembled
from .cpu import PROFILE
from .weights import _prepared_dir


@dataclass(frozen=True)
class PreparedFile:
    path: Path
    bytes: int
    why: str  # why no start here reads it


def stale_files() -> list[PreparedFile]:
    """The files and entries of `prepared/` that no start on this machine reads again, and the catalog's
    assembled files, largest first."""
    stale = [
        PreparedFile(path, path.stat().st_size, "packed: assembled again from its pip packages where needed")
        for path in (model_path(m) for m in KNOWN_MODELS.values())
        if path.is_file() and packed_file.holds_model(path) and has_packages(assembled_model_at(path))
    ]
    folder = cache_dir() / "prepared"
    if not folder.is_dir():
        return stale
    in_use = {model_path(m) for m in KNOWN_MODELS.values()}
    for path in sorted(folder.glob("*.packed")):
        why, gguf = _stale_packed(path)
        if why:
            stale.append(PreparedFile(path, path.stat().st_size, why))
        if gguf is not None:  # its metadata serves every profile
            in_use.add(gguf)
    wanted = {_prepared_dir(p) for p in in_use if p.is_file() or assembled_model_at(p)}
    for entry in sorted(p for p in folder.iterdir() if p.is_dir() and p not in wanted):
        why = "left half-written" if entry.name.startswith(".") else "metadata of a model no longer here"
        stale.append(PreparedFile(entry, _size(entry), why))
    return sorted(stale, key=lambda f: -f.bytes)


def remove(files: list[PreparedFile]) -> None:
    for f in files:
        model = assembled_model_at(f.path)
        if model is not None:
            remove_assembled(model)  # with its record
        elif f.path.is_dir():
            shutil.rmtree(f.path, ignore_errors=True)
        else:
            f.path.unlink(missing_ok=True)


def _stale_packed(path: Path) -> tuple[str, Path | None]:
    """Why no start reads this packed file ("" when one does), and the GGUF it was packed from."""
    header = packed_file.header_of(path)
    try:
        gguf = Path(header["gguf"]["path"])
    except (TypeError, KeyError):
        return "not a whole packed file", None
    if header.get("profile") != PROFILE.key:
        return f"packed for another machine profile ({header.get('profile')})", gguf
    if header.get("layout") != packed_file.LAYOUT_VERSION:
        return "packed in another layout (by another version of llama-chat)", gguf
    identity = header["gguf"]
    if packed_file.source_gone(identity):
        return f"its model is gone ({gguf})", None
    if identity != packed_file.gguf_identity(gguf):
        return f"its model changed since ({gguf})", gguf
    return "", gguf


def _size(entry: Path) -> int:
    return sum(p.stat().st_size for p in entry.rglob("*") if p.is_file())
