"""Who may choose a decode instance's prefill peer (the ``X-Radixserve-Prefill`` header).

A decode instance connects to the prefill peer a request names and puts the KV that peer
sends into its radix tree, where later requests of the same namespace reuse it. So any
caller may name only ``local`` (compute here), the instance's own ``--prefill-endpoint`` or
a ``--trusted-prefill`` endpoint; any other peer needs the admin key (a router in
prefill/decode mode holds it). Anything else is a 400: the instance never connects to an
address a tenant chose.
"""

from __future__ import annotations

from radixserve.api.errors import ApiError
from radixserve.config import DisaggConfig
from radixserve.disagg.decode_side import PREFILL_HERE


class PrefillTrust:
    def __init__(self, disagg: DisaggConfig, trusted: list[str]):
        self.decode = disagg.disaggregation_mode == "decode"
        self.trusted = {*trusted, disagg.prefill_endpoint, PREFILL_HERE} - {None}

    def peer(self, named: str | None, admin: bool) -> str | None:
        """``named`` if this caller may choose it (not a decode instance: the engine refuses
        any peer itself), else an ``ApiError`` 400."""
        if named is None or not self.decode or named in self.trusted or admin:
            return named
        raise ApiError(
            400,
            f"X-Radixserve-Prefill names {named!r}, not a prefill instance this server "
            "trusts: list it with --trusted-prefill, or send the header with the admin key",
            "X-Radixserve-Prefill",
        )
