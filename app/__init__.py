"""What a person touches: the `llama-chat` command line and the Textual TUI."""
