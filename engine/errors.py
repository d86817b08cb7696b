"""Errors the engine raises for bad requests. All are ValueErrors naming the problem."""


class PromptTooLongError(ValueError):
    """The prompt (plus at least one new token) does not fit in max_model_len."""

    def __init__(self, num_prompt_tokens: int, max_model_len: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len
        super().__init__(
            f"prompt: {num_prompt_tokens} tokens leave no room to generate within max_model_len={max_model_len} "
            "(this model's maximum context length)"
        )


class EngineDeadError(RuntimeError):
    """The engine's background loop failed; the request cannot be served."""
