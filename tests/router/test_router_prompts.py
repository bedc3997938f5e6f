"""The router names a request's blocks exactly as the worker's tree will: same tokens (the
server's request models and chat template), same namespace (the server's rule over
``cache_salt`` and, with ``--salt-from-api-key``, the caller's tenant)."""

from radixserve.api.guard import cache_namespace, key_tenant
from radixserve.kvevents.hashing import prompt_block_hashes
from radixserve.router.prompts import route_request

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "tell me about radix trees " * 8}]


def hashes(default_tokenizer, namespace):
    ids = default_tokenizer.encode_chat(MESSAGES)
    return list(prompt_block_hashes(ids, 16, namespace))


def test_requests_hash_in_the_namespace_the_server_gives_them(default_tokenizer):
    def routed(body, tenant=None):
        body = {"model": "m", "messages": MESSAGES, **body}
        req = route_request(CHAT, body, {}, default_tokenizer, 16, tenant)
        assert req.num_tokens == len(default_tokenizer.encode_chat(MESSAGES))
        return list(req.block_hashes)

    shared = hashes(default_tokenizer, None)
    assert len(shared) >= 4
    assert routed({}) == shared
    salted = routed({"cache_salt": "s1"})
    assert salted == hashes(default_tokenizer, cache_namespace(None, "s1"))
    assert set(salted).isdisjoint(shared) and routed({"cache_salt": "s2"}) != salted
    tenant = routed({}, key_tenant("k1"))
    assert tenant == hashes(default_tokenizer, cache_namespace(key_tenant("k1"), None))
    assert set(tenant).isdisjoint(shared)
    both = routed({"cache_salt": "s1"}, key_tenant("k1"))
    assert both == hashes(default_tokenizer, cache_namespace(key_tenant("k1"), "s1"))


def test_the_agent_apis_route_on_the_prompt_the_worker_renders(default_tokenizer):
    """A Messages and a Responses body with the same conversation and tools hash like the
    chat completions body the worker renders alike; their own session keys keep a
    conversation on one worker, and a continuation of a stored response routes by key."""
    from radixserve.router.prompts import prompt_ids, session_key

    fn = {"name": "f", "description": "d", "parameters": {"type": "object"}}
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Hi"}],
            "tools": [{"type": "function", "function": fn}]}  # fmt: skip
    messages = {
        "model": "m",
        "max_tokens": 5,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
    }
    responses = {"instructions": "Be brief.", "input": "Hi", "tools": [{"type": "function", **fn}]}
    ids = prompt_ids("/v1/chat/completions", chat, default_tokenizer)
    assert ids and prompt_ids("/v1/messages", messages, default_tokenizer) == ids
    assert prompt_ids("/v1/responses", responses, default_tokenizer) == ids
    assert prompt_ids("/v1/responses", {**responses, "previous_response_id": "r"},
                      default_tokenizer) is None  # fmt: skip
    assert session_key({}, {**responses, "prompt_cache_key": "k"}) == "k"
    assert session_key({}, {**messages, "metadata": {"user_id": "u"}}) == "u"
    assert session_key({"x-session-id": "s"}, {"prompt_cache_key": "k"}) == "s"
