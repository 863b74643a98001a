"""`python -m llama_chat` runs the same CLI as the `llama-chat` script."""

from llama_chat.app.cli import main

raise SystemExit(main())
