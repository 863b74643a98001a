"""Packed weights kept in the cache: a later load maps them, and any doubt about the file packs it again."""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import mmap
import os
import resource
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from test_synthetic_model import TINY, synthetic

from llama_chat.inference import formats, gguf_tensors, load_model, packed_file, quants
from llama_chat.inference.model import Model
from llama_chat.inference.weights import _prepared_dir, prepare
from tiny_models import write_tiny_model

TEXT = "hello the world, the sun and the water"


def loaded(path):
    """(model, whether this load packed the weights: the step its progress shows)"""
    steps = []
    model = load_model(path, progress=lambda label, done, total: steps.append(label))
    return model, any(s.startswith("packing") for s in steps)


def unpacked_logits(path) -> np.ndarray:
    """Logits with the weights packed in memory, no cache involved."""
    model = Model(prepare(path, use_cache=False))
    return model.logits(model.tokenizer.encode(TEXT))


def logits(model) -> np.ndarray:
    return model.logits(model.tokenizer.encode(TEXT))


def packed_files(path) -> list:
    return sorted(packed_file.packed_path(path).parent.glob(f"*{packed_file.packed_path(path).suffix}*"))


@pytest.fixture
def q4_k_m(tmp_path, qwen2):
    """A tiny model in llama.cpp's Q4_K_M types: Q4_K kept in its bits, Q6_K too where the profile keeps
    it so (formats.Q6_K_IN_BITS; else int8), Q4_K beside Q6_K (layer 0's q/k/v) as a StackedMatrix of
    both."""
    return synthetic.write_synthetic(tmp_path / "synthetic.gguf", "tiny", TINY["qwen2"], qwen2)


def test_a_second_load_maps_the_packed_file_and_gives_the_same_logits(tiny_model_path):
    first, packed = loaded(tiny_model_path)
    second, packed_again = loaded(tiny_model_path)
    assert packed and not packed_again
    expected = unpacked_logits(tiny_model_path)
    assert np.array_equal(logits(first), expected) and np.array_equal(logits(second), expected)
    assert len(packed_files(tiny_model_path)) == 1


def from_the_file(a: np.ndarray) -> bool:
    """Whether an array's memory is the packed file's mapping."""
    while a is not None and not isinstance(a, mmap.mmap):
        a = a.obj if isinstance(a, memoryview) else a.base
    return a is not None


def test_no_mmap_reads_the_weights_into_memory_of_their_own_with_progress_and_the_same_logits(qwen2):
    mapped = loaded(qwen2)[0]
    steps = []
    own = load_model(qwen2, progress=lambda *step: steps.append(step), use_mmap=False)
    reading = [(done, total) for label, done, total in steps if label == f"reading {qwen2.name} into memory"]
    assert len(reading) > 3 and reading == sorted(reading) and reading[-1][0] == reading[-1][1]
    matrices = own.weights.matrices()
    assert matrices and not any(from_the_file(m.values) for m in matrices)
    assert all(from_the_file(m.values) for m in mapped.weights.matrices())
    before = logits(own)
    assert np.array_equal(before, logits(mapped))
    # The file overwritten in place, as no llama-chat ever writes it: the mapped weights read the new
    # bytes, the model's own memory keeps those it checked.
    _overwrite_middle(packed_file.packed_path(qwen2))
    assert np.array_equal(logits(own), before)
    with np.errstate(all="ignore"):  # (random bytes as weights)
        assert not np.array_equal(logits(mapped), before)


def test_no_mmap_finds_a_damaged_file_as_it_reads_it(qwen2, caplog):
    before = logits(loaded(qwen2)[0])
    _overwrite_middle(packed_file.packed_path(qwen2))
    steps = []
    model = load_model(qwen2, progress=lambda label, *_: steps.append(label), use_mmap=False)
    assert any(s.startswith("packing") for s in steps)
    assert np.array_equal(logits(model), before)
    assert _one_line(caplog).startswith(f"{packed_file.packed_path(qwen2)}: damaged (")


def test_weights_that_do_not_fit_in_the_memory_available_are_mapped_with_one_line(qwen2, caplog, monkeypatch):
    before = logits(loaded(qwen2)[0])
    monkeypatch.setattr(packed_file, "available_memory", lambda: 1 << 30)  # less than a GiB to spare
    model = load_model(qwen2, use_mmap=False)
    line = _one_line(caplog)
    assert line.startswith(f"{packed_file.packed_path(qwen2).name}: ") and "mapping them" in line
    assert all(from_the_file(m.values) for m in model.weights.matrices())
    assert np.array_equal(logits(model), before)


def test_packing_shows_progress_that_moves(qwen2):
    steps = []
    load_model(qwen2, progress=lambda *step: steps.append(step))
    packing = [(done, total) for label, done, total in steps if label == f"packing {qwen2.name}"]
    assert len(packing) > 3 and packing == sorted(packing) and packing[-1][0] == packing[-1][1]
    assert (f"saving {qwen2.name}", 0, 0) in steps  # then the disk's sync, of unknown length


def test_q4_k_m_weights_map_bit_for_bit(q4_k_m):
    loaded(q4_k_m)
    model, packed = loaded(q4_k_m)
    assert not packed
    assert model.weights.layers[1].ffn_gate_up.in_q4_k  # kept in its GGUF bits, mapped
    q_k, v = model.weights.layers[0].attn_qkv.parts  # q/k in Q4_K, v in Q6_K: two runs, each mapped
    assert q_k.in_q4_k and v.in_q6_k == formats.Q6_K_IN_BITS
    assert q_k.small and v.small  # kept with them: their weights' sums may add up in 16 bits
    assert np.array_equal(logits(model), unpacked_logits(q4_k_m))


def test_q6_k_is_taken_as_int8_by_float32_inputs(q4_k_m):
    """The exact mode reads the same packed file, its Q6_K matrices turned into int8 at the load (float32
    inputs multiply int8 faster: quants.for_inputs), and gives the logits it gives unpacked."""
    load_model(q4_k_m)
    model = load_model(q4_k_m, activations="f32")
    _, v = model.weights.layers[0].attn_qkv.parts
    assert v.values.dtype == np.int8 and model.weights.layers[1].ffn_gate_up.in_q4_k
    unpacked = Model(prepare(q4_k_m, use_cache=False, activations="f32"))
    assert np.array_equal(logits(model), unpacked.logits(unpacked.tokenizer.encode(TEXT)))


def in_page_cache(path, offset: int, length: int) -> float:
    """The share of those bytes of a file that the page cache holds, by pages: mincore(2) over a mapping
    of them, which reads nothing (a read that may not wait would itself start reading ahead)."""
    page = mmap.PAGESIZE
    first, n = offset // page, (offset + length - 1) // page - offset // page + 1
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    where = ctypes.c_char.from_buffer(mapped, first * page)
    address, pages = ctypes.c_void_p(ctypes.addressof(where)), (ctypes.c_ubyte * n)()
    done = ctypes.CDLL(None).mincore(address, ctypes.c_size_t(n * page), pages)
    del where
    mapped.close()
    assert done == 0
    return sum(p & 1 for p in pages) / n


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no advice to the page cache (macOS, Windows)")
def test_an_embedding_table_is_read_into_the_page_cache_in_the_background_whatever_its_size(tmp_path):
    # (a 7B's table is 300 MB; one request to read ahead reads no more than the disk's readahead window)
    path, mb = tmp_path / "model.gguf", 1 << 20
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 48 * mb, np.uint8).tobytes())
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # as after a restart of the machine
    os.close(fd)
    if in_page_cache(path, 0, mb) == 1:
        pytest.skip("this file system keeps the file in the page cache whatever it is told")
    gguf_tensors.read_ahead(path, 3 * mb + 100, 40 * mb).join()  # the table: 40 MB from 3 MB on
    # The reads were asked for; they end soon after, busy disk or not. One request alone reads no more
    # than the readahead window (~1 % of the table); a machine short of memory (a full test suite) may
    # take back a few pages read before the last arrive, hence not every page.
    for _ in range(600):
        if in_page_cache(path, 3 * mb + 100, 40 * mb) >= 0.95:
            break
        time.sleep(0.05)
    assert in_page_cache(path, 3 * mb + 100, 40 * mb) >= 0.95


def test_a_changed_gguf_is_packed_again(tmp_path):
    path = write_tiny_model(tmp_path / "model.gguf", "qwen2", seed=1)
    old = logits(loaded(path)[0])
    write_tiny_model(path, "qwen2", seed=2)  # other weights under the same name
    model, packed = loaded(path)
    assert packed
    new = logits(model)
    assert np.array_equal(new, unpacked_logits(path)) and not np.array_equal(new, old)
    assert len(packed_files(path)) == 1  # in place of the old one


@pytest.mark.parametrize("change", ["layout version", "machine profile"])
def test_another_layout_or_profile_is_packed_again(qwen2, monkeypatch, change):
    loaded(qwen2)
    if change == "layout version":
        monkeypatch.setattr(packed_file, "LAYOUT_VERSION", packed_file.LAYOUT_VERSION + 1)
    else:
        other = dataclasses.replace(packed_file.PROFILE, cpu_name="another-cpu")
        monkeypatch.setattr(packed_file, "PROFILE", other)
    model, packed = loaded(qwen2)
    assert packed
    assert np.array_equal(logits(model), unpacked_logits(qwen2))
    assert len(packed_files(qwen2)) == (1 if change == "layout version" else 2)  # a file per profile


def _truncate(path, by):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - by)


def _flip_byte(path, from_end):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - from_end)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x20]))


def _overwrite_middle(path):
    """A run of random bytes over the middle of the arrays (1 MiB in the probe that found it used),
    the header and trailer left whole."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        f.write(os.urandom(min(1 << 20, size // 16)))


DAMAGE = {
    "bytes overwritten in its arrays": _overwrite_middle,
    "cut by a byte": lambda p: _truncate(p, 1),
    "cut in half": lambda p: _truncate(p, os.path.getsize(p) // 2),
    "empty": lambda p: _truncate(p, os.path.getsize(p)),
    "a byte of its header changed": lambda p: _flip_byte(p, packed_file.TRAILER.size + 20),
    "a byte of its trailer changed": lambda p: _flip_byte(p, 3),
    "other bytes": lambda p: p.write_bytes(os.urandom(os.path.getsize(p))),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_packed_file_is_packed_again_with_one_line(qwen2, damage, caplog):
    before = logits(loaded(qwen2)[0])
    DAMAGE[damage](packed_file.packed_path(qwen2))
    model, packed = loaded(qwen2)
    assert packed
    assert np.array_equal(logits(model), before)
    line = _one_line(caplog)
    assert line.startswith(f"{packed_file.packed_path(qwen2)}: damaged (")
    assert line.endswith(f"; packing {qwen2.name} again")
    assert not loaded(qwen2)[1]  # and whole again


def test_a_whole_file_without_the_models_matrices_is_packed_again(qwen2):
    """A file with a valid header for this GGUF but other arrays (one matrix only) is not trusted."""
    model, _ = loaded(qwen2)
    target = packed_file.packed_path(qwen2)
    packed_file.write_packed(
        target, packed_file.gguf_identity(qwen2), iter([("output", model.weights.output)]), 0
    )
    again, packed = loaded(qwen2)
    assert packed and np.array_equal(logits(again), unpacked_logits(qwen2))


def test_a_crash_while_packing_leaves_no_file_a_later_load_trusts(qwen2, monkeypatch):
    pack, calls = quants.pack, []

    def crashing(parts, own):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # as a Ctrl-C halfway through
        return pack(parts, own)

    monkeypatch.setattr(quants, "pack", crashing)
    with pytest.raises(KeyboardInterrupt):
        load_model(qwen2)
    assert packed_files(qwen2) == []  # neither the file nor its temporary
    monkeypatch.setattr(quants, "pack", pack)
    model, packed = loaded(qwen2)
    assert packed and np.array_equal(logits(model), unpacked_logits(qwen2))


def test_a_temporary_file_of_a_process_gone_is_removed(qwen2):
    target = packed_file.packed_path(qwen2)
    target.parent.mkdir(parents=True)
    abandoned = target.with_name(f".{target.name}.999999999.tmp")  # no process has this id
    abandoned.write_bytes(b"\0" * 4096)
    loaded(qwen2)
    assert packed_files(qwen2) == [target]


def test_the_packed_file_of_a_gguf_gone_is_removed_by_the_next_packing(tmp_path, qwen2):
    gone = write_tiny_model(tmp_path / "gone.gguf", "llama")
    loaded(gone)
    gone.unlink()
    assert packed_file.packed_path(gone).exists()
    loaded(qwen2)
    assert not packed_file.packed_path(gone).exists() and packed_file.packed_path(qwen2).exists()



def test_models_prune_lists_and_removes_what_no_start_reads(tmp_path, qwen2, monkeypatch, capsys):
    """Packed files of another machine profile and of a GGUF gone, and the gone one's metadata, go;
    what the models here read stays, and their next start packs nothing again."""
    from llama_chat.app.cli import main

    gone = write_tiny_model(tmp_path / "gone.gguf", "llama")
    loaded(gone)
    with monkeypatch.context() as other_machine:
        other_machine.setattr(
            packed_file, "PROFILE", dataclasses.replace(packed_file.PROFILE, cpu_name="another-cpu")
        )
        loaded(qwen2)
        elsewhere = packed_file.packed_path(qwen2)
    loaded(qwen2)
    gone.unlink()
    folder = packed_file.packed_path(qwen2).parent
    before = sorted(folder.iterdir())
    assert len(before) == 5  # two GGUFs' metadata, three packed files

    assert main(["models", "--prune", "--dry-run"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert sorted(folder.iterdir()) == before  # only listed
    stale = [line for line in listed if " MB  " in line]
    assert len(stale) == 3 and listed[3] == f"would remove 3 file(s), {listed[3].split(', ')[1]}"
    assert any(f"{elsewhere}  (packed for another machine profile (another-cpu-" in line for line in stale)
    assert any(f"{packed_file.packed_path(gone)}  (its model is gone ({gone}))" in line for line in stale)
    assert any(line.endswith("(metadata of a model no longer here)") for line in stale)

    assert main(["models", "--prune"]) == 0
    assert capsys.readouterr().out.splitlines()[3].startswith("removed 3 file(s)")
    assert set(folder.iterdir()) == {packed_file.packed_path(qwen2), _prepared_dir(qwen2)}
    assert not loaded(qwen2)[1]  # its own packed file and metadata stayed
    assert main(["models", "--prune"]) == 0
    assert capsys.readouterr().out.startswith("nothing to remove")


def _one_line(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "\n" not in lines[0]
    return lines[0]


def test_a_cache_folder_that_cannot_be_written_unpacks_in_memory_with_one_line(qwen2, caplog):
    folder = packed_file.packed_path(qwen2).parent
    folder.parent.mkdir(parents=True)
    folder.write_text("a file where the folder should be")
    model, packed = loaded(qwen2)
    line = _one_line(caplog)
    assert str(folder) in line and "unpacked in memory" in line and qwen2.name in line
    assert np.array_equal(logits(model), unpacked_logits(qwen2))


@pytest.mark.parametrize("full", ["a write fails", "less free than needed"])
def test_a_full_disk_unpacks_in_memory_with_one_line(qwen2, caplog, monkeypatch, full):
    load_model(qwen2, progress=None)  # kernels compiled and metadata kept before the disk fills
    packed_file.packed_path(qwen2).unlink()
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead
    if full == "a write fails":
        resource.setrlimit(resource.RLIMIT_FSIZE, (16384, limit[1]))  # as a disk with 16 kB left
    else:
        monkeypatch.setattr(packed_file, "SPARE_BYTES", 2**62)  # no disk has that much to spare
    try:
        model, _ = loaded(qwen2)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)
    line = _one_line(caplog)
    assert "unpacked in memory" in line
    if full == "less free than needed":
        assert "GB needed" in line and "GB free" in line
    assert packed_files(qwen2) == []  # no partial file left
    assert np.array_equal(logits(model), unpacked_logits(qwen2))


CUT_SHORT_UNDER_IT = """
import os, sys
from llama_chat.inference import load_model, packed_file
model = load_model(sys.argv[1])
os.truncate(packed_file.packed_path(sys.argv[1]), 0)  # as another program would, while it is mapped
model.logits(model.tokenizer.encode("hello"))
print("read the weights of a file cut short")
"""


def test_a_packed_file_cut_short_under_a_running_process_ends_it_with_one_line(qwen2):
    loaded(qwen2)  # packed here: the child only maps it
    child = [sys.executable, "-c", CUT_SHORT_UNDER_IT, str(qwen2)]
    run = subprocess.run(child, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and run.stdout == ""
    # numba's two threads may both fault before the process is gone: each writes the same line
    assert set(run.stderr.splitlines()) == {
        "llama-chat: a file mapped into memory (a model's GGUF or its packed weights) was cut short by "
        "another program while in use; stopping"
    }
