"""``/admin/pins``: pin, list and unpin prefixes by hand (an admin path: the admin key).

- ``POST /admin/pins``: a prefix given as ``token_ids``, ``text`` (tokenized as a completion
  prompt is) or chat ``messages`` (rendered with the chat template, without the turn that
  asks for an answer, as the start of a chat prompt renders), for ``ttl`` ("5m", "1h" or
  seconds), counted against ``tenant``'s budget (the name ``/metrics`` shows) and in the cache
  namespace that tenant's requests with ``cache_salt`` use. The
  prefix is computed if it is not cached (a one-token request), then pinned; the answer is
  the pin. A prefix longer than the budget is a 400; one that could not be pinned (evicted
  again before the pin was taken) a 409.
- ``GET /admin/pins``: every pin, most recently used first, with its tenant, size, time left
  and a digest of its first tokens (their text only with ``debug_cache_text``), and the
  budgets and totals.
- ``DELETE /admin/pins``: the pin ``id``, the pins of a prefix (given as for ``POST``, in
  ``tenant``'s space), or with ``all`` every pin; the answer says how many were dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

import msgspec
from fastapi import FastAPI, Request
from pydantic import BaseModel, Field, model_validator

from radixserve.api.body import MAX_SALT_CHARS, STRICT, TokenId
from radixserve.api.chat_input import TTLS
from radixserve.api.config import ServerConfig
from radixserve.api.errors import ApiError
from radixserve.api.guard import cache_namespace
from radixserve.cache.pins import PinInfo
from radixserve.engine.sampling_params import SamplingParams
from radixserve.model.tokenizer import Tokenizer
from radixserve.server.admin_routes import engine_call, token_digest
from radixserve.server.chat_run import request_spec
from radixserve.server.serving import Serving

PINS_PATH = "/admin/pins"


class PrefixBody(BaseModel):
    model_config = STRICT
    token_ids: list[TokenId] | None = Field(default=None, min_length=1)
    text: str | None = Field(default=None, min_length=1)
    messages: list[dict[str, Any]] | None = Field(default=None, min_length=1)
    tenant: str | None = Field(default=None, min_length=1, max_length=256)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_SALT_CHARS)

    def given(self) -> int:
        return sum(x is not None for x in (self.token_ids, self.text, self.messages))

    def tokens(self, tokenizer: Tokenizer) -> list[int]:
        if self.token_ids is not None:
            return self.token_ids
        if self.text is not None:
            return tokenizer.encode(self.text)
        text = tokenizer.render_chat(self.messages or [], add_generation_prompt=False)
        return tokenizer.encode(text, add_special_tokens=False)

    def namespace(self, config: ServerConfig) -> str | None:
        """The cache namespace the tenant's requests with this ``cache_salt`` use (its own
        only under ``--salt-from-api-key``)."""
        return cache_namespace(self.tenant if config.salt_from_api_key else None, self.cache_salt)


class PinBody(PrefixBody):
    ttl: Literal["5m", "1h"] | Annotated[int, Field(ge=1, le=3600)] = "5m"

    @model_validator(mode="after")
    def _one_prefix(self) -> PinBody:
        if self.given() != 1:
            raise ValueError("give the prefix as one of token_ids, text or messages")
        return self


class UnpinBody(PrefixBody):
    id: int | None = None
    all: bool = False

    @model_validator(mode="after")
    def _one_choice(self) -> UnpinBody:
        if self.given() + (self.id is not None) + self.all != 1:
            raise ValueError("give one of id, all, token_ids, text or messages")
        return self


def pin_json(pin: PinInfo, tokenizer: Tokenizer, show_text: bool) -> dict[str, Any]:
    out = dataclasses.asdict(pin)
    head = out.pop("head_token_ids")
    if show_text:
        out["head_text"] = tokenizer.decode(head, skip_special_tokens=False)
    else:  # who pinned what stays private, as in /cache
        out["head_hash"] = token_digest(head)
    return out


def add_pin_routes(
    app: FastAPI, serving: Serving, tokenizer: Tokenizer, config: ServerConfig
) -> None:
    client = serving.client

    @app.get(PINS_PATH)
    async def list_pins() -> dict:
        stats = await engine_call(client, "stats")
        pins = await engine_call(client, "pin_listing")
        p = stats.pins
        return {
            "enabled": p is not None,
            "budget_tokens": p.budget_tokens if p else 0,
            "tenant_budget_tokens": p.tenant_budget_tokens if p else 0,
            "pinned_tokens": p.pinned_tokens if p else 0,
            "tenant_tokens": p.tenant_tokens if p else {},
            "pins": [pin_json(x, tokenizer, config.debug_cache_text) for x in pins],
        }

    @app.post(PINS_PATH)
    async def pin(body: PinBody, raw: Request) -> dict:
        stats = await engine_call(client, "stats")
        if stats.pins is None:
            raise ApiError(400, "pins are off on this server (--pin-budget 0 or no prefix cache)")
        ids = await serving.off_loop(body.tokens, tokenizer)
        budget = min(stats.pins.budget_tokens, stats.pins.tenant_budget_tokens)
        if len(ids) > budget:
            raise ApiError(400, f"the prefix has {len(ids)} tokens; the pin budget is {budget}")
        ttl = float(TTLS[body.ttl] if isinstance(body.ttl, str) else body.ttl)
        spec = request_spec(raw, None, pins=((len(ids), ttl),), tenant=body.tenant)
        spec = msgspec.structs.replace(spec, namespace=body.namespace(config))
        params = SamplingParams(max_tokens=1, temperature=0.0)
        job, queue = await serving.submit("pin", [ids], [params], spec)
        await serving.wait(job, queue, raw)
        page = client.info.page_size
        for p in await engine_call(client, "pin_listing"):
            held = p.tenant == (body.tenant or "") and p.namespace == body.namespace(config)
            if held and p.tokens == len(ids) // page * page:
                return pin_json(p, tokenizer, config.debug_cache_text)
        raise ApiError(409, "the prefix was computed but evicted before it could be pinned")

    @app.delete(PINS_PATH)
    async def unpin(body: UnpinBody) -> dict:
        ids = None
        if body.given():
            ids = await serving.off_loop(body.tokens, tokenizer)
        n = await engine_call(client, "unpin", token_ids=ids, namespace=body.namespace(config),
                              tenant=body.tenant, pin_id=body.id)  # fmt: skip
        return {"unpinned": n}
