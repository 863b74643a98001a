"""The chat layer under every front end (TUI, CLI, server): settings, jobs, the scheduler that runs
them, and the chat engine over stored conversations. No UI, HTTP or terminal code here."""
