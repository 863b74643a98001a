"""The TUI's colour themes, as data files (*.toml)."""
