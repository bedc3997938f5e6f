"""The Responses API's store: what ``previous_response_id`` continues, per tenant, in memory.

Each tenant (the caller's API key; everyone, without keys) keeps its last
``ServerConfig.stored_responses`` responses (least recently used first out). A record holds
the response as ``GET /v1/responses/{id}`` returns it and the conversation it ended (the
input turns and the output, without the instructions, which a continuation gives anew). An
id of another tenant is not found, exactly as an unknown one: ids are never shared across
tenants. The conversation's KV needs no storing here: it is in the radix tree already, so a
continuation's prompt is served from the cache up to its new input.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]


class ResponseStore:
    def __init__(self, per_tenant: int):
        self.per_tenant = per_tenant
        self._tenants: dict[str | None, OrderedDict[str, StoredResponse]] = {}

    def put(self, tenant: str | None, record: StoredResponse) -> None:
        if self.per_tenant == 0:
            return
        kept = self._tenants.setdefault(tenant, OrderedDict())
        kept[record.response["id"]] = record
        kept.move_to_end(record.response["id"])
        while len(kept) > self.per_tenant:
            kept.popitem(last=False)

    def get(self, tenant: str | None, response_id: str) -> StoredResponse | None:
        kept = self._tenants.get(tenant)
        record = kept.get(response_id) if kept else None
        if record is not None:
            kept.move_to_end(response_id)
        return record

    def delete(self, tenant: str | None, response_id: str) -> bool:
        kept = self._tenants.get(tenant)
        return bool(kept) and kept.pop(response_id, None) is not None

    def __len__(self) -> int:
        return sum(len(kept) for kept in self._tenants.values())
