"""TreeNode: one edge of the radix tree and where its tokens' KV lives.

A node's KV is on the device (``value``: device slot indices), on the host (``host_value``:
host slot indices), or on both; a tree without lower tiers only ever has ``value``. For a
model whose sliding-window layers keep their KV apart, ``window`` says whether those layers'
KV is still there on the device (``window_tree.py``). The
fields the tree keeps for eviction, events and statistics sit beside them.
Nothing here moves KV: the tier controller does, and the tree records the result.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class TreeNode:
    __slots__ = (
        "id",
        "parent",
        "children",
        "key",
        "value",
        "host_value",
        "lock_ref",
        "last_access",
        "hit_count",
        "page_hashes",
        "offset",
        "namespace",
        "depth",
        "created",
        "policy_state",
        "window",
        "window_lock",
        "host_window",
        "turn_end",
    )

    def __init__(
        self,
        node_id: int,
        parent: TreeNode | None,
        key: np.ndarray,
        value: torch.Tensor | None,
        namespace: Any = None,
    ):
        self.id = node_id
        self.parent = parent
        self.children: dict[Any, TreeNode] = {}
        self.key = key
        self.value = value  # device slots, or None: not on the device
        self.host_value: torch.Tensor | None = None  # host slots, or None: not on the host
        self.lock_ref = 0
        self.last_access = 0
        self.hit_count = 0
        self.page_hashes: list[int] = []  # the KV-event blocks it owns (tree_events.py)
        self.offset = 0  # tokens above its edge, kept while events are on
        self.namespace = namespace
        self.depth = 0  # tokens from the root to the end of this edge
        self.created = 0  # the cache's admission count when this node was cached
        self.policy_state: Any = None  # the eviction policy's own (eviction.py)
        # models with window layers kept apart (window_tree.py): whether the node's device
        # slots still have their window layers' KV (False: a tombstone), and how many
        # requests need that KV (the node lies in the window before their resume point)
        self.window = True
        self.window_lock = 0
        self.host_window = True  # whether the host copy has the window layers' KV
        self.turn_end = False  # its edge ends right after a chat turn (window_tree.py)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"
