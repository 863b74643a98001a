"""Model provisioning: chunks found through package metadata, assembled once, verified, errors."""

from __future__ import annotations

import hashlib
import json

import pytest
from gguf import GGMLQuantizationType as Q

from llama_chat.app.cli import main
from llama_chat.inference import catalog
from llama_chat.inference.catalog import KNOWN_MODELS, KnownModel, ensure_model, model_path
from tiny_models import write_tiny_model

CHUNKS = [b"GGUF" + b"first chunk " * 1000, b"second chunk " * 2000, b"last"]


def install_fake_packages(root, chunks, name="fakemodel") -> KnownModel:
    """Write installed-looking distributions (dist-info + data file) that importlib.metadata finds."""
    parts = []
    for i, data in enumerate(chunks, start=1):
        dist, pkg = f"{name}-part{i}", f"{name}_part{i}"
        info = root / f"{pkg}-1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        rel = f"{pkg}/data/part{i:02d}.bin"
        (root / rel).parent.mkdir(parents=True)
        (root / rel).write_bytes(data)
        (info / "RECORD").write_text(f"{rel},,\n")
        parts.append((dist, rel))
    whole = b"".join(chunks)
    return KnownModel(
        name, tuple(parts), "1.0", hashlib.sha256(whole).hexdigest(), len(whole), "a fake model"
    )


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    model = install_fake_packages(tmp_path / "site", CHUNKS)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(KNOWN_MODELS, model.name, model)
    return model


def test_assembles_once_then_reuses_without_hashing(fake_model, monkeypatch):
    seen = []
    path = ensure_model(fake_model, progress=lambda label, done, total: seen.append((label, done, total)))
    assert path == model_path(fake_model)
    assert path.read_bytes() == b"".join(CHUNKS)
    assert path.parent.name == "models" and "llama-chat" in str(path)
    assert seen[-1][0].startswith("assembling") and seen[-1][1] == seen[-1][2] == fake_model.size
    assert not list(path.parent.glob("*.tmp"))  # assembled through a temporary file and a rename

    def no_hashing(*args, **kwargs):
        raise AssertionError("a verified file must not be hashed again")

    monkeypatch.setattr(catalog, "_sha256", no_hashing)
    assert ensure_model(fake_model) == path


def test_missing_packages_print_the_pip_command(tmp_path, monkeypatch, capsys):
    model = KnownModel(
        "ghost", (("ghost-model-part1", "ghost/data/p.bin"),), "2.0", "0" * 64, 1, "not installed"
    )
    monkeypatch.setitem(KNOWN_MODELS, "ghost", model)
    assert main(["--model", "ghost", "tokenize", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "llama-chat: error: model ghost: package ghost-model-part1 is not installed; "
        "run: pip install 'ghost-model-part1==2.0'"
    )


def test_checksum_mismatch_deletes_the_file(tmp_path, monkeypatch, capsys):
    model = install_fake_packages(tmp_path / "site", CHUNKS, name="badsum")
    model = KnownModel(model.name, model.chunks, model.version, "f" * 64, model.size, "wrong checksum")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(KNOWN_MODELS, model.name, model)
    assert main(["--model", "badsum", "tokenize", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "model badsum: checksum mismatch" in err and "the bad file was deleted" in err
    assert not model_path(model).exists()
    assert not list(model_path(model).parent.iterdir())  # no temporary file left behind either


def test_corrupt_cached_file_is_detected_deleted_and_rebuilt(fake_model):
    path = ensure_model(fake_model)
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    messages = []
    assert ensure_model(fake_model, progress=lambda label, done, total: messages.append(label)) == path
    assert any("was corrupt and has been deleted" in m for m in messages)
    assert path.read_bytes() == b"".join(CHUNKS)


def test_models_command_lists_status(fake_model, capsys):
    assert main(["models", "--json"]) == 0
    before = {m["name"]: m for m in json.loads(capsys.readouterr().out)}
    assert before["fakemodel"]["packages_installed"] and not before["fakemodel"]["assembled"]
    assert "qwen2.5-coder-0.5b-instruct-q4_k_m" in before and "gemma-3-270m-q4_k_m" in before
    qwen = before["qwen2.5-coder-0.5b-instruct-q4_k_m"]
    assert (qwen["sampling"]["temperature"], qwen["sampling"]["top_k"], qwen["sampling"]["top_p"]) == (
        0.7,
        20,
        0.8,
    )
    assert qwen["sampling_from"] == "Qwen2.5's model card"
    assert before["fakemodel"]["sampling_from"] == "llama.cpp's defaults"
    ensure_model(fake_model)
    assert main(["models"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("fakemodel"))
    assert "verified" in line and str(model_path(fake_model)) in line


def test_a_path_or_a_name(tmp_path, tiny_model_paths):
    assert catalog.resolve_model(tiny_model_paths["qwen2"]) == tiny_model_paths["qwen2"]
    with pytest.raises(catalog.ModelError, match="unknown model 'mistery'"):
        catalog.resolve_model("mistery")


def test_models_tells_what_a_gguf_needs_and_whether_it_runs(tmp_path, tiny_model_paths, capsys):
    """`llama-chat models FILE…`: each file's architecture, tokenizer and matrix formats with how each
    is kept, and whether it runs; where one does not, its first line is the one loading it gives."""
    moe = tiny_model_paths["qwen3moe"]
    foreign = write_tiny_model(tmp_path / "foreign.gguf", "qwen2", arch_name="mamba9")
    odd = write_tiny_model(tmp_path / "odd.gguf", "qwen2", raw_types={"blk.0.ffn_up.weight": Q.Q8_1})
    assert main(["models", str(moe)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{moe}: runs" and "  architecture: qwen3moe" in out
    assert "  Q8_0: 5 matrices, int8 with a scale per 16 or 32 weights" in out
    assert main(["models", "--json", str(moe), str(foreign), str(odd)]) == 1
    needs = json.loads(capsys.readouterr().out)
    assert [n["problem"] is None for n in needs] == [True, False, False]
    assert (needs[1]["architecture"], needs[1]["architecture_supported"]) == ("mamba9", False)
    assert "unsupported architecture 'mamba9'" in needs[1]["problem"]
    assert needs[2]["formats"]["Q8_1"] == {"tensors": 1, "kept": "not read here"}
    assert main(["--model", str(odd), "tokenize", "x"]) == 2  # the same line as loading it
    assert needs[2]["problem"] in capsys.readouterr().err
    assert main(["models", str(tmp_path / "nope.gguf")]) == 2
    assert "no such file" in capsys.readouterr().err
