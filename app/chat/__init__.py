"""The chat layer under every front end: settings, jobs, the scheduler and the chat engine (no UI code)."""
