"""The cheap refusal of a prompt too long for its model, before anything is tokenized or reserved: one of the
model's tokens stands for at most `longest_token_chars` characters, so a prompt of C characters has at least
C / that many tokens, and one that cannot fit in max_model_len is refused by its length alone (a 400 naming the
field and the bound). What passes is tokenized off the event loop (engine/async_engine.py) and checked exactly."""

from __future__ import annotations

from gateway.backends import BackendInfo
from gateway.errors import context_length_exceeded


def refuse_overlong(model: str, info: BackendInfo, *, chars: int = 0, token_ids: int = 0,
                    field: str = "messages") -> None:
    """`chars`: the prompt text's length (a chat's message contents added up); `token_ids`: the length of a
    prompt given as token ids. Raises the 400 when the prompt cannot fit; returns when it may."""
    limit = info.max_model_len
    if not limit:
        return
    if token_ids >= limit:
        raise context_length_exceeded(
            f"{field}: the prompt is {token_ids:,} tokens and model `{model}` reads at most {limit:,} tokens "
            "(prompt and completion together); shorten it.", field)
    longest = info.longest_token_chars
    if longest and chars // longest >= limit:
        raise context_length_exceeded(
            f"{field}: the prompt is {chars:,} characters long, and model `{model}` reads at most {limit:,} tokens "
            f"of at most {longest} characters each (prompt and completion together): a prompt of "
            f"{limit * longest:,} characters or more cannot fit. Shorten it.", field)
