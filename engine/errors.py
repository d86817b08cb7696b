"""Errors the engine raises for bad requests. All are ValueErrors naming the problem."""


class PromptTooLongError(ValueError):
    """The prompt (plus at least one new token), or the prompt plus the max_tokens asked for, does not fit in
    max_model_len."""

    def __init__(self, num_prompt_tokens: int, max_model_len: int, max_tokens: int | None = None,
                 at_least: bool = False) -> None:
        """`at_least`: num_prompt_tokens is a lower bound counted from the text's length, before tokenizing."""
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len
        self.max_tokens = max_tokens
        self.at_least = at_least
        if max_tokens is None:
            count = f"at least {num_prompt_tokens}" if at_least else str(num_prompt_tokens)
            message = (f"prompt: {count} tokens leave no room to generate within "
                       f"max_model_len={max_model_len} (this model's maximum context length)")
        else:
            message = (f"max_tokens: this model's maximum context length is {max_model_len} tokens, but "
                       f"{num_prompt_tokens + max_tokens} were requested ({num_prompt_tokens} in the prompt, "
                       f"{max_tokens} in the completion); reduce the prompt or max_tokens")
        super().__init__(message)

    def __reduce__(self) -> tuple:
        # pickled by its fields (Ray, worker processes): the default would call __init__ with the message alone
        return type(self), (self.num_prompt_tokens, self.max_model_len, self.max_tokens, self.at_least)


class EngineDeadError(RuntimeError):
    """The engine's background loop failed; the request cannot be served."""


class EngineAsleepError(RuntimeError):
    """A step was asked of a sleeping engine (engine/sleep.py), or a request waited longer than
    sleep_wait_timeout_s for it to wake."""
