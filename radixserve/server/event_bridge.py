"""Between the engine's step loop and its KV-event publisher (both in the engine process).

``sync`` runs after every step and every batch of messages, in the engine thread (the only
thread that may touch the tree): it switches the engine's events on when the publisher has a
subscriber and off when the last one leaves, hands the events of the last step to the
publisher, and answers dump requests with a snapshot of the tree. With no subscriber it costs
two attribute reads.
"""

from __future__ import annotations

from radixserve.engine import Engine
from radixserve.kvevents.publisher import KVEventPublisher


class EventBridge:
    def __init__(self, engine: Engine, publisher: KVEventPublisher):
        self.engine, self.publisher = engine, publisher
        self.on = False

    def sync(self) -> None:
        pub, engine = self.publisher, self.engine
        if pub.subscribed != self.on:
            self.on = pub.subscribed
            engine.set_kv_events(self.on)
        if self.on:
            pub.publish(engine.drain_kv_events())
        if pub._dumps:
            for client in pub.take_dump_requests():
                pub.send_dump(client, engine.kv_events_snapshot())
