"""The one error type a user can cause in the inference core: its message is a single clear line."""


class ModelError(Exception):
    """A model (or tokenizer) file that cannot be used: missing, corrupt, foreign or unsupported.

    The message names the thing and the problem in one line; the CLI prints it and exits with 2.
    """


class ContextFullError(ModelError):
    """More tokens than the context window holds."""


class TooManyTokens(ContextFullError):
    """A text found to make more than `limit` tokens before all of it was tokenized."""

    def __init__(self, limit: int):
        super().__init__(f"the text makes more than {limit:,} tokens")
        self.limit = limit
