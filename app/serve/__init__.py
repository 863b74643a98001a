"""`llama-chat serve`: an OpenAI-compatible HTTP server on the chat layer's scheduler, every client
sharing one KV block pool that persists in the conversation database."""
