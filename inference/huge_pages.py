"""Weights on 2 MB pages: a file written so that the page cache holds it in huge-page folios, and a
mapping advised to map it with huge-page entries (docs/performance.md, "Weights on 2 MB pages").

Decode streams every weight once a token; on 4 KB pages it misses the TLB every 4 KB, and reads
memory slower than on 2 MB pages. Where the kernel keeps a file's page cache in folios of a huge page
(Linux 6.x on ext4, XFS and others), a mapping of the file maps each such folio with one entry, for
every process that maps it. A write of a whole aligned huge page gets such a folio; a write that begins
or ends inside one leaves that page in small folios, so the file is written in whole blocks."""

from __future__ import annotations

import mmap
from pathlib import Path

HUGE_PAGE_SIZE = Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")
HUGE_PAGE = 2 << 20  # x86-64's and arm64's (4 KB pages) where the kernel does not say


def huge_page_bytes() -> int:
    try:
        return int(HUGE_PAGE_SIZE.read_text())
    except (OSError, ValueError):
        return HUGE_PAGE


def advise_huge(mapped: mmap.mmap) -> bool:
    """Ask the kernel to map `mapped` with huge-page entries, and to read what a fault reads of the file
    into huge-page folios; whether it took the advice (not where it has no transparent huge pages)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mapped.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel built without them
        return False
    return True


class BlockWriter:
    """Writes to an unbuffered file (open(..., buffering=0)) from its start in whole blocks of a huge
    page, holding back what does not fill one: each block the page cache takes in one folio."""

    def __init__(self, raw) -> None:
        self.raw, self.block = raw, huge_page_bytes()
        self.pending, self.written = bytearray(), 0

    def tell(self) -> int:
        return self.written + len(self.pending)

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        if self.pending:
            room = self.block - len(self.pending)
            self.pending += view[:room]
            view = view[room:]
            if len(self.pending) < self.block:
                return
            self._write_out(self.pending)
            self.pending = bytearray()
        whole = len(view) // self.block * self.block
        self._write_out(view[:whole])
        self.pending += view[whole:]

    def flush(self) -> None:
        """Writes what is held back (the file's last, partial block)."""
        self._write_out(self.pending)
        self.pending = bytearray()

    def _write_out(self, data) -> None:
        """One write a block: a write the kernel finds short of its source's pages (memory pressure) goes on
        in smaller folios to its end, so that a long one would leave the rest of an array in them."""
        view = memoryview(data)
        for at in range(0, len(view), self.block):
            block = view[at : at + self.block]
            while block:
                block = block[self.raw.write(block) :]
        self.written += len(data)
