"""The router's two worker sets in prefill/decode mode (``radixserve router --prefill URL...
--decode URL...``): a ``WorkerPool`` of decode instances whose policy is a ``PDPolicy``, and
a pool of prefill instances under that policy's prefill side. Both pools subscribe to their
workers' KV events and health-check them. Each worker must say it plays its role
(``GET /disagg/info``); a prefill instance's KV endpoint is read there too (a restarted
prefill engine binds the same one).
"""

from __future__ import annotations

import httpx

from radixserve.links.keys import ZmqSecurity
from radixserve.router.pd import PDPolicy
from radixserve.router.policy import PolicyConfig, make_policy
from radixserve.router.workers import WorkerError, WorkerPool, _reachable


async def disagg_role(client: httpx.AsyncClient, url: str, role: str) -> dict:
    """The worker's ``/disagg/info``, checked to be in ``role``; ``WorkerError`` otherwise."""
    try:
        r = await client.get(f"{url.rstrip('/')}/disagg/info", timeout=10)
        info = r.json() if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError) as e:
        raise WorkerError(f"cannot ask {url} for its role: {type(e).__name__}: {e}") from e
    mode = info.get("mode")
    if mode != role:
        raise WorkerError(
            f"{url} is not a {role} instance (its disaggregation mode is {mode!r}); start it "
            f"with --disaggregation-mode {role}"
        )
    return info


class PDPools:
    def __init__(
        self,
        client: httpx.AsyncClient,
        policy_name: str,
        config: PolicyConfig,
        seed: int,
        local_prefill_tokens: int,
        security: ZmqSecurity,
    ):
        self.client = client
        prefill_policy = make_policy(policy_name, config, seed)
        self.policy = PDPolicy(
            prefill_policy, make_policy(policy_name, config, seed + 1), local_prefill_tokens
        )
        self.decode = WorkerPool(self.policy, client, security)
        self.prefill = WorkerPool(prefill_policy, client, security)

    async def add_prefill(self, url: str) -> None:
        info = await disagg_role(self.client, url, "prefill")
        worker = await self.prefill.add(url)
        self.policy.endpoints[worker.url] = _reachable(info["endpoint"], worker.url)
        self._check_model()

    async def add_decode(self, url: str) -> None:
        await disagg_role(self.client, url, "decode")
        await self.decode.add(url)
        self._check_model()

    def _check_model(self) -> None:
        p, d = self.prefill.model, self.decode.model
        if p is not None and d is not None and p != d:
            raise WorkerError(f"prefill instances serve {p!r} but decode instances serve {d!r}")

    def start(self) -> None:
        self.decode.start()
        self.prefill.start()

    async def close(self) -> None:
        await self.decode.close()
        await self.prefill.close()
