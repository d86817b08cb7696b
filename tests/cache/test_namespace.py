from cache.namespace import TenantCacheSettings, namespace_for_request


def req(**kw):
    base = {"model": "auto", "temperature": 0, "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
    ]}
    base.update(kw)
    return base


def test_greedy_request_is_cacheable_and_prompt_is_last_user_turn():
    d = namespace_for_request("t1", "small", req())
    assert d.cacheable
    assert d.prompt == "What is the capital of France?"
    assert d.namespace.tenant == "t1"


def test_temperature_above_zero_needs_opt_in():
    assert not namespace_for_request("t1", "small", req(temperature=0.7)).cacheable
    assert not namespace_for_request("t1", "small", req(temperature=None)).cacheable  # OpenAI default is 1
    opted = TenantCacheSettings(cache_sampled=True)
    assert namespace_for_request("t1", "small", req(temperature=0.7), opted).cacheable


def test_namespace_separates_everything_that_changes_the_answer():
    base = namespace_for_request("t1", "small", req()).namespace
    assert namespace_for_request("t2", "small", req()).namespace != base
    assert namespace_for_request("t1", "large", req()).namespace != base
    assert namespace_for_request("t1", "small", req(max_tokens=5)).namespace != base
    assert namespace_for_request("t1", "small", req(seed=3)).namespace != base
    other_system = req(messages=[{"role": "system", "content": "You are verbose."},
                                 {"role": "user", "content": "What is the capital of France?"}])
    assert namespace_for_request("t1", "small", other_system).namespace != base
    # Only the last user turn is compared semantically, so it is not part of the namespace;
    # fields that do not change the answer are not either.
    other_q = req(messages=[{"role": "system", "content": "You are terse."},
                            {"role": "user", "content": "Capital of Spain?"}])
    assert namespace_for_request("t1", "small", other_q).namespace == base
    assert namespace_for_request("t1", "small", req(stream=True, user="u9")).namespace == base


def test_structured_output_fields_separate_namespaces():
    base = namespace_for_request("t1", "small", req()).namespace
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    variants = [req(response_format={"type": "json_object"}),
                req(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}),
                req(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {**schema,
                                                                                                  "required": ["a"]}}}),
                req(structured_outputs={"regex": "a+"}), req(structured_outputs={"regex": "b+"}),
                req(guided_json=schema), req(guided_regex="a+"), req(guided_choice=["x", "y"]),
                req(guided_grammar='root ::= "x"')]
    keys = {namespace_for_request("t1", "small", v).namespace for v in variants}
    assert len(keys) == len(variants) and base not in keys


def test_earlier_turns_are_hashed_exactly():
    turns = [{"role": "user", "content": "Pick a city."}, {"role": "assistant", "content": "Paris."},
             {"role": "user", "content": "How big is it?"}]
    a = namespace_for_request("t1", "small", req(messages=turns)).namespace
    turns2 = [dict(m) for m in turns]
    turns2[1]["content"] = "Rome."
    assert namespace_for_request("t1", "small", req(messages=turns2)).namespace != a


def test_not_cacheable_cases():
    assert not namespace_for_request("t1", "s", req(n=2)).cacheable
    assert not namespace_for_request("t1", "s", req(messages=[])).cacheable
    assert not namespace_for_request("t1", "s", req(messages=[{"role": "assistant", "content": "x"}])).cacheable
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert not namespace_for_request("t1", "s", req(messages=image)).cacheable
    assert not namespace_for_request("t1", "s", req(), TenantCacheSettings(enabled=False)).cacheable


def test_every_answer_changing_field_separates_namespaces():
    """Every field not known to leave the answer alone splits the namespace, even one the cache has never heard of
    (a field added to the request models later can only split namespaces)."""
    base = namespace_for_request("t1", "small", req()).namespace
    variants = [req(logit_bias={"12": 5.0}), req(logit_bias={"12": -5.0}), req(seed=1), req(stop=["\n"]),
                req(stop=["."]), req(presence_penalty=1.0), req(frequency_penalty=1.0), req(top_p=0.5),
                req(max_completion_tokens=9), req(response_format={"type": "json_object"}),
                req(tools=[{"type": "function", "function": {"name": "f"}}]), req(tool_choice="required"),
                req(some_future_field=True)]
    keys = {namespace_for_request("t1", "small", v).namespace for v in variants}
    assert len(keys) == len(variants) and base not in keys


def test_fields_that_leave_the_answer_alone_share_the_namespace():
    base = namespace_for_request("t1", "small", req()).namespace
    same = req(stream=True, stream_options={"include_usage": True}, user="u", safety_identifier="s",
               metadata={"tags": "a"}, store=False, service_tier="auto", prompt_cache_key="k")
    assert namespace_for_request("t1", "small", same).namespace == base


def test_the_last_speakers_name_is_part_of_the_namespace():
    named = req(messages=[{"role": "system", "content": "You are terse."},
                          {"role": "user", "content": "What is the capital of France?", "name": "bob"}])
    assert namespace_for_request("t1", "small", named).namespace != namespace_for_request("t1", "small", req()).namespace


def test_logprobs_requests_are_not_cached():
    assert not namespace_for_request("t1", "s", req(logprobs=True)).cacheable
    assert not namespace_for_request("t1", "s", req(logprobs=False, top_logprobs=0)).cacheable
    assert namespace_for_request("t1", "s", req(logprobs=False)).cacheable


def test_tool_fields_separate_namespaces():
    """A request with tools is never answered with what a request without them (or with other tools) got."""
    base = namespace_for_request("t1", "small", req()).namespace
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    other = {"type": "function", "function": {"name": "get_date", "parameters": {"type": "object"}}}
    variants = [req(tools=[tool]), req(tools=[other]), req(tools=[tool], tool_choice="required"),
                req(tools=[tool], tool_choice={"type": "function", "function": {"name": "get_time"}}),
                req(tools=[tool], parallel_tool_calls=False)]
    keys = {namespace_for_request("t1", "small", v).namespace for v in variants}
    assert len(keys) == len(variants) and base not in keys
