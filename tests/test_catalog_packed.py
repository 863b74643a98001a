"""A catalog model on disk once: its pip packages, and once packed for this machine its packed file, which
holds all a start reads; the assembled GGUF is not kept, and whatever is found damaged is rebuilt from
the packages with one line, or refused with one where they are gone."""

from __future__ import annotations

import json
import logging
import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
from test_catalog import install_fake_packages

from llama_chat.app.cli import main
from llama_chat.inference import KNOWN_MODELS, load_model, packed_file
from llama_chat.inference.catalog import ModelError, cache_dir, model_path
from llama_chat.inference.model import Model
from llama_chat.inference.weights import _prepared_dir, prepare
from tiny_models import write_tiny_model

TEXT = "hello the world, the sun and the water"


def _logits(model) -> np.ndarray:
    return model.logits(model.tokenizer.encode(TEXT))


def _start(name):
    """(model, the steps its start showed)"""
    steps = []
    model = load_model(name, progress=lambda label, done, total: steps.append(label))
    return model, steps


def _did(steps, step) -> bool:
    return any(s.startswith(step) for s in steps)


def _cache_files() -> dict[str, int]:
    """What a user finds under the cache folder (kernels compiled aside): path → bytes."""
    root = cache_dir()
    return {
        str(p.relative_to(root)): p.stat().st_size
        for p in root.rglob("*")
        if p.is_file() and p.relative_to(root).parts[0] != "numba"
    }


@pytest.fixture(params=["qwen2", "gemma3"])
def shipped(request, tmp_path, monkeypatch):
    """A tiny model shipped as the catalog ships one: its GGUF cut into three pip packages (qwen2 with an
    embedding table of its own, gemma3's tied to its output), and what it computes unpacked."""
    gguf = write_tiny_model(tmp_path / "tiny.gguf", request.param)
    data = gguf.read_bytes()
    third = len(data) // 3
    model = install_fake_packages(
        tmp_path / "site", [data[:third], data[third : 2 * third], data[2 * third :]], name="tinyshipped"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(KNOWN_MODELS, model.name, model)
    return SimpleNamespace(model=model, expected=_logits(Model(prepare(gguf, use_cache=False))))


def test_a_first_start_keeps_the_packed_file_not_the_assembled_gguf(shipped):
    model, steps = _start(shipped.model.name)
    assert _did(steps, "assembling") and _did(steps, "packing")
    assert np.array_equal(_logits(model), shipped.expected)
    files = _cache_files()
    packed = packed_file.packed_path(model_path(shipped.model))
    assert not model_path(shipped.model).exists() and not [f for f in files if f.endswith(".gguf")]
    entry = _prepared_dir(model_path(shipped.model))
    assert set(files) == {str(packed.relative_to(cache_dir()))} | {
        str((entry / f).relative_to(cache_dir())) for f in ("metadata.json", "info.json", "complete")
    }

    again, steps = _start(shipped.model.name)  # reads nothing of a GGUF: there is none
    assert not _did(steps, "assembling") and not _did(steps, "packing") and not _did(steps, "reading")
    assert np.array_equal(_logits(again), shipped.expected)
    assert _cache_files() == files


def test_the_models_command_says_packed(shipped, capsys):
    _start(shipped.model.name)
    assert main(["models", "--json"]) == 0
    status = next(m for m in json.loads(capsys.readouterr().out) if m["name"] == shipped.model.name)
    assert status["packed"] and not status["assembled"]
    assert main(["models"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(shipped.model.name))
    assert " packed " in line and str(packed_file.packed_path(model_path(shipped.model))) in line


def _flip_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _one_line(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "\n" not in lines[0]
    return lines[0]


def test_a_damaged_packed_file_is_packed_again_from_the_packages(shipped, caplog):
    _start(shipped.model.name)
    packed = packed_file.packed_path(model_path(shipped.model))
    files = _cache_files()
    _flip_byte(packed, 4096 + 10)  # a byte of an array: only its digest tells
    model, steps = _start(shipped.model.name)
    assert _did(steps, "assembling") and _did(steps, "packing")
    assert _one_line(caplog).startswith(f"{packed}: damaged (the bytes of ")
    assert np.array_equal(_logits(model), shipped.expected)
    assert _cache_files() == files  # whole again, and the GGUF assembled for it removed again


def test_a_damaged_metadata_entry_is_read_again_from_the_packages(shipped, caplog):
    _start(shipped.model.name)
    entry = _prepared_dir(model_path(shipped.model))
    metadata = json.loads((entry / "metadata.json").read_text())
    metadata["tokenizer.chat_template"] = "{{ 'not the model template' }}"  # still valid JSON
    (entry / "metadata.json").write_text(json.dumps(metadata))
    model, steps = _start(shipped.model.name)
    assert _did(steps, "assembling") and _did(steps, "reading")
    assert _one_line(caplog).startswith(f"{entry}: damaged (its files are not those written)")
    assert model.metadata.get("tokenizer.chat_template") != "{{ 'not the model template' }}"
    assert np.array_equal(_logits(model), shipped.expected)
    assert not model_path(shipped.model).exists()


def _uninstall(site):
    for part in site.iterdir():
        shutil.rmtree(part)


def test_without_its_packages_a_packed_model_starts_and_a_damaged_one_is_refused(shipped, tmp_path):
    _start(shipped.model.name)
    _uninstall(tmp_path / "site")
    model, steps = _start(shipped.model.name)
    assert np.array_equal(_logits(model), shipped.expected)
    packed = packed_file.packed_path(model_path(shipped.model))
    os.truncate(packed, packed.stat().st_size // 2)
    with pytest.raises(ModelError) as refused:
        _start(shipped.model.name)
    known = shipped.model
    assert str(refused.value) == (
        f"model {known.name}: package tinyshipped-part1 is not installed; run: {known.pip_command()}"
    )


def test_an_assembled_gguf_asked_for_stays(shipped):
    """ensure_model's file (for a benchmark, for llama.cpp) is not removed by a start that packs nothing."""
    from llama_chat.inference.catalog import ensure_model

    _start(shipped.model.name)
    path = ensure_model(shipped.model)
    _, steps = _start(shipped.model.name)
    assert not _did(steps, "packing") and path.exists()
    assert np.array_equal(_logits(load_model(str(path))), shipped.expected)


def test_prune_keeps_what_a_packed_catalog_model_reads(shipped, capsys):
    _start(shipped.model.name)
    files = _cache_files()
    assert main(["models", "--prune"]) == 0
    assert capsys.readouterr().out.startswith("nothing to remove")
    assert _cache_files() == files


def test_prune_removes_an_assembled_gguf_asked_for_once_the_model_is_packed(shipped, capsys):
    from llama_chat.inference.catalog import ensure_model

    _start(shipped.model.name)
    files = _cache_files()
    path = ensure_model(shipped.model)
    assert main(["models", "--prune", "--dry-run"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[0].endswith(f"MB  {path}  (packed: assembled again from its pip packages where needed)")
    assert listed[1].startswith("would remove 1 file(s)") and len(listed) == 2  # no pip uninstall offered
    assert main(["models", "--prune"]) == 0
    assert _cache_files() == files
    model, steps = _start(shipped.model.name)
    assert not _did(steps, "assembling") and np.array_equal(_logits(model), shipped.expected)


def test_without_its_packages_the_assembled_gguf_stays_its_source(shipped, tmp_path):
    """A model whose packages were uninstalled (as `models --prune` once offered) keeps its GGUF: the packed
    file alone could not be packed again for another profile or layout."""
    from llama_chat.inference.catalog import ensure_model

    path = ensure_model(shipped.model)
    _uninstall(tmp_path / "site")
    model, steps = _start(shipped.model.name)
    assert _did(steps, "packing") and path.exists()
    assert np.array_equal(_logits(model), shipped.expected)


def test_a_start_by_its_path_keeps_the_assembled_gguf(shipped):
    """A GGUF loaded by its path was asked for itself: packing from it removes nothing, and a later
    start by name, which packs nothing, neither."""
    from llama_chat.inference.catalog import ensure_model

    path = ensure_model(shipped.model)
    model, steps = _start(str(path))
    assert _did(steps, "packing") and path.exists()
    again, steps = _start(shipped.model.name)
    assert not _did(steps, "packing") and path.exists()
    assert np.array_equal(_logits(again), shipped.expected)


def test_an_import_finds_a_packed_models_fingerprint_without_assembling_it(shipped):
    from argparse import Namespace

    from llama_chat.app.commands_sessions import model_here

    model, _ = _start(shipped.model.name)
    assert model_here(Namespace(model=shipped.model.name)) == (model.fingerprint, None)
    assert not model_path(shipped.model).exists()
