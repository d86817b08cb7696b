"""The streamed delta events built from a per-request prefix are the bytes the plain JSON encoding makes."""

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.backends import ChoiceDelta
from gateway.openai_format import ChatFormat, CompletionFormat, sse

FINISH = st.sampled_from([None, "stop", "length", "abort"])


@settings(max_examples=300, deadline=None)
@given(rid=st.text(max_size=40), model=st.text(min_size=1, max_size=40), created=st.integers(0, 2**40),
       index=st.integers(0, 16), text=st.text(max_size=60), finish=FINISH, chat=st.booleans())
def test_fast_delta_events_equal_the_json_encoding(rid, model, created, index, text, finish, chat):
    fmt = ChatFormat(False) if chat else CompletionFormat(False)
    c = ChoiceDelta(index, text, 1, finish)
    assert fmt.delta_event(rid, created, model, c) == sse(fmt.delta(rid, created, model, c))
