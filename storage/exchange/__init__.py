"""Session export and import files (.llamachat): a conversation and its KV, checked, bounded, portable.

format.py says the layout and its limits; reader.py reads a file back with every check (and writes
nothing); writer.py exports a session; importer.py adds a read file's sessions to the store."""

from .format import (
    HEADER_SIZE,
    MAGIC,
    MAX_DATA_BYTES,
    MAX_MANIFEST_BYTES,
    SUFFIX,
    ExchangeError,
    declared_size,
)
from .importer import ImportResult, import_session
from .reader import SessionFile, read_session_file
from .writer import ExportSummary, default_file_name, export_session, write_whole

__all__ = [
    "HEADER_SIZE",
    "MAGIC",
    "MAX_DATA_BYTES",
    "MAX_MANIFEST_BYTES",
    "SUFFIX",
    "ExchangeError",
    "ExportSummary",
    "ImportResult",
    "SessionFile",
    "declared_size",
    "default_file_name",
    "export_session",
    "import_session",
    "read_session_file",
    "write_whole",
]
