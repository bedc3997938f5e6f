"""The KV pool: preallocated K and V tensors for every layer, indexed by token slot.

``k[layer]`` and ``v[layer]`` have shape ``[num_kv_heads, num_slots + 1, row_width]``: rows in
the shape's ``KVFormat`` (``kv_format.py``), ``head_dim`` values of the model's dtype by
default, or int8 codes with their scales (``--kv-cache-dtype int8``). ``write`` encodes into
the format, ``gather`` decodes to the model's dtype (the PyTorch attention path); the native
kernels read the rows as stored (``layer_kv``). The pool
only stores; which slots are free, cached or held is the business of the allocator, the radix
tree and the requests. Size it by a token count or by a memory budget (``slots_for_memory``).

A model with sliding-window layers may keep their KV apart (``window_map`` given): ``k`` and
``v`` then hold the global layers only, ``wk`` and ``wv`` the window layers, in a pool of
their own addressed through ``window_map`` (main slot -> window slot, kept by the
``WindowedAllocator``, ``window_pages.py``). ``layer_kv``, ``slots_for``, ``write`` and
``gather`` take a model layer index and a main slot, whichever group the layer is in.

An int8 pool may keep some layers' KV in the model's dtype (``float_layers``: Qwen2's first
layers, whose keys carry biases int8 groups flatten, docs/caching.md): ``k`` and ``v`` then
hold the int8 layers, ``fk`` and ``fv`` the float ones, at the same slots. ``layer_format``
says how a layer is stored. What leaves the device pool as rows (host and storage pages, the
transfer wire) is the pool's int8 format for every layer (``layer_rows``): float layers are
encoded on the way out and decoded on the way in.

An int8 format may store keys' channels in a per-layer order (``KeyOrder``, the shape's
``key_order``: what the model's keys want, ``int8_format``). The rows keep that order in every
tier and on the wire; ``write`` applies it, ``gather`` and every decode undo it, so values
read back as floats are in the model's order; the kernels reading rows as stored take the
queries in the same order (``KVFormat.stored_queries``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixserve.cache.kv_format import KeyOrder, KVFormat


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the model's: what ``write`` takes and ``gather`` returns
    window_layers: tuple[int, ...] = ()  # layers with a sliding window
    # how the pool stores KV; None: plain values of ``dtype``
    kv_format: KVFormat = field(default=None)  # type: ignore[assignment]
    # int8 pools: layers whose KV stays in the model's dtype
    float_layers: tuple[int, ...] = ()
    # the order int8 rows store the keys' channels in (``int8_format``); None: as computed
    key_order: KeyOrder | None = None

    def __post_init__(self) -> None:
        if self.kv_format is None:
            object.__setattr__(self, "kv_format", KVFormat.of(self.dtype))
        self.kv_format.check_dim(self.head_dim)
        if not self.kv_format.quantized and self.kv_format.storage_dtype != self.dtype:
            raise ValueError(f"a float KV format is the model's dtype ({self.dtype}), "
                             f"not {self.kv_format.name}")  # fmt: skip
        object.__setattr__(self, "float_layers", tuple(sorted(set(self.float_layers))))
        if self.float_layers and not self.kv_format.quantized:
            raise ValueError("float KV layers are for an int8 pool; this one is float already")
        for layer in self.float_layers:
            if not 0 <= layer < self.num_layers:
                raise ValueError(f"float KV layer {layer}: the model has layers "
                                 f"0..{self.num_layers - 1}")  # fmt: skip
        if self.float_layers and self.window_layers:
            raise ValueError("float KV layers in a model with window layers are not supported")

    def with_format(self, kv_format: KVFormat, float_layers: tuple[int, ...] = ()) -> KVShape:
        """The same shape stored in another format (``float_layers`` kept in the dtype)."""
        return KVShape(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype,
                       self.window_layers, kv_format, float_layers, self.key_order)  # fmt: skip

    @property
    def int8_format(self) -> KVFormat:
        """The int8 format for this model's keys: groups of ``INT8_GROUP``, the key order."""
        return KVFormat.of("int8").with_key_order(self.key_order)

    def layer_format(self, layer: int) -> KVFormat:
        """How ``layer``'s KV is stored."""
        return KVFormat.of(self.dtype) if layer in self.float_layers else self.kv_format

    @property
    def format_name(self) -> str:
        """The pool's format for logs and stats: ``int8g16``, ``int8g16+float32@0,1``, ..."""
        if not self.float_layers:
            return self.kv_format.name
        float_name = KVFormat.of(self.dtype).name
        return f"{self.kv_format.name}+{float_name}@{','.join(map(str, self.float_layers))}"

    @property
    def row_bytes(self) -> int:
        """One token's K (or V) of one head in one layer of the pool's (int8) format."""
        return self.kv_format.row_bytes(self.head_dim)

    def layer_bytes(self, layer: int | None = None) -> int:
        """K and V of one token in ``layer`` (None: a layer of the pool's ``kv_format``)."""
        fmt = self.kv_format if layer is None else self.layer_format(layer)
        return 2 * self.num_kv_heads * fmt.row_bytes(self.head_dim)

    def bytes_per_token(self) -> int:
        return sum(self.layer_bytes(i) for i in range(self.num_layers))

    def slots_for_memory(self, num_bytes: int, page_size: int = 1, window_share: float = 0) -> int:
        """How many slots (whole pages) a budget of ``num_bytes`` holds; with
        ``window_share``, the window layers' KV is kept for that share of the slots only."""
        if num_bytes <= 0:
            raise ValueError(f"KV cache memory budget must be positive, got {num_bytes} bytes")
        per_token = self.bytes_per_token()
        if window_share:
            local = len(self.window_layers)
            per_token = (self.num_layers - local + window_share * local) * self.layer_bytes()
        slots = int(num_bytes // per_token)
        return slots // page_size * page_size


class KVPool:
    """``k[layer]`` and ``v[layer]`` are ``[num_kv_heads, num_slots + 1, row_width]``.

    Head-major, so a gather of any slots is already ``[heads, n, dim]``, the layout attention
    wants, without a transpose copy. ``gather`` fills reusable scratch buffers: its result is
    valid until the next ``gather`` call (attention uses each one at once).
    """

    def __init__(
        self,
        shape: KVShape,
        num_slots: int,
        device: str | torch.device = "cpu",
        window_map: torch.Tensor | None = None,
        window_slots: int = 0,
    ):
        if num_slots <= 0:
            raise ValueError(f"the KV pool needs at least one slot, got {num_slots}")
        self.shape = shape
        self.format = shape.kv_format
        self.num_slots = num_slots
        self.device = torch.device(device)
        # One extra, zeroed slot: the padding that batched decode reads for positions it
        # masks out. Every other slot is written before it is read, so it starts uninitialised
        # (zeroing gigabytes would take seconds at start-up).
        self.pad_slot = num_slots
        window = set(shape.window_layers) if window_map is not None else set()
        floats = set(shape.float_layers)
        # model layer -> (its group: "main", "window" or "float", its index in the group)
        kinds = ["window" if i in window else "float" if i in floats else "main"
                 for i in range(shape.num_layers)]  # fmt: skip
        self.groups = [(kind, kinds[:i].count(kind)) for i, kind in enumerate(kinds)]
        # the model's layer indices kept in the main pool, the window pool, the float pool
        self.main_layers, self.window_layers, self.float_layers = (
            torch.tensor([i for i, k in enumerate(kinds) if k == kind], dtype=torch.int64)
            for kind in ("main", "window", "float")
        )  # fmt: skip
        self.k, self.v = self._storage(kinds.count("main"), num_slots, self.format)
        self.window_map = window_map  # on the CPU: the allocator updates it in place
        self.window_slots = 0
        if window:
            self.window_slots = window_slots  # also the window pool's pad slot
            self.wk, self.wv = self._storage(len(window), self.window_slots, self.format)
        self.float_format = KVFormat.of(shape.dtype)
        if floats:
            self.fk, self.fv = self._storage(len(floats), num_slots, self.float_format)
        self._scratch = torch.empty(0, dtype=shape.dtype, device=self.device)
        self._layer_events: list | None = None  # CUDA: a load from the host tier in flight

    def _storage(self, layers: int, slots: int,
                 fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        shape = self.shape
        size = (layers, shape.num_kv_heads, slots + 1, fmt.row_width(shape.head_dim))
        k = torch.empty(size, dtype=fmt.storage_dtype, device=self.device)
        v = torch.empty(size, dtype=fmt.storage_dtype, device=self.device)
        k[:, :, slots].zero_()
        v[:, :, slots].zero_()
        return k, v

    @property
    def windowed(self) -> bool:
        """Whether the window layers' KV lives in a pool of its own."""
        return self.window_slots > 0

    @property
    def has_float_layers(self) -> bool:
        return len(self.float_layers) > 0

    def in_window(self, layer: int) -> bool:
        """Whether ``layer``'s KV lives in the window pool (at window slots)."""
        return self.groups[layer][0] == "window"

    def layer_format(self, layer: int) -> KVFormat:
        """How ``layer``'s KV is stored."""
        return self.float_format if self.groups[layer][0] == "float" else self.format

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The storage ``[num_kv_heads, slots + 1, row_width]`` holding ``layer``'s K and V."""
        kind, i = self.groups[layer]
        if kind == "window":
            return self.wk[i], self.wv[i]
        return (self.fk[i], self.fv[i]) if kind == "float" else (self.k[i], self.v[i])

    def slots_for(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Where ``layer``'s KV of these main slots lives in ``layer_kv(layer)``."""
        return self.to_window(slots) if self.in_window(layer) else slots

    def layer_rows(self, kv: int, lo: int, hi: int, slots: torch.Tensor) -> torch.Tensor:
        """K (``kv`` 0) or V (1) of layers ``[lo, hi)`` at ``slots`` as rows of the pool's
        format ``[hi - lo, heads, n, row_width]`` (float layers encoded), a fresh tensor. Not
        for window layers kept apart."""
        main = (self.k, self.v)[kv]
        if not self.has_float_layers:
            return main[lo:hi].index_select(2, slots)
        rows = []
        for layer in range(lo, hi):
            kind, i = self.groups[layer]
            if kind == "float":
                values = (self.fk, self.fv)[kv][i].index_select(1, slots)
                rows.append(self.format.encode(values, keys_of=layer if kv == 0 else None))
            else:
                rows.append(main[i].index_select(1, slots))
        return torch.stack(rows)

    def put_layer_rows(self, kv: int, lo: int, hi: int, slots: torch.Tensor,
                       rows: torch.Tensor) -> None:  # fmt: skip
        """Store ``rows`` (``layer_rows``' shape and format) at ``slots`` of layers
        ``[lo, hi)``: float layers decoded to the model's dtype."""
        main = (self.k, self.v)[kv]
        if not self.has_float_layers:
            main[lo:hi].index_copy_(2, slots, rows)
            return
        for layer in range(lo, hi):
            kind, i = self.groups[layer]
            if kind == "float":
                keys_of = layer if kv == 0 else None
                values = self.format.decode(rows[layer - lo], self.shape.head_dim,
                                            self.shape.dtype, keys_of)  # fmt: skip
                (self.fk, self.fv)[kv][i].index_copy_(1, slots, values)
            else:
                main[i].index_copy_(1, slots, rows[layer - lo])

    def to_window(self, slots: torch.Tensor) -> torch.Tensor:
        """The window slots of these main slots (the window pool's pad slot where none)."""
        return self.window_map[slots.cpu()].to(slots.device, non_blocking=True)

    def wait_for_layers(self, events: list) -> None:
        """Make the next forward pass wait, layer by layer, for a copy into the pool (one
        CUDA event per layer, recorded on the copy's stream)."""
        self._layer_events = events

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V given as ``[n, num_kv_heads, head_dim]`` into ``slots`` of one layer.
        The forward pass calls it first for every layer, before reading the layer's KV."""
        if self._layer_events is not None:
            torch.cuda.current_stream(self.device).wait_event(self._layer_events[layer])
            if layer == len(self._layer_events) - 1:
                self._layer_events = None
        kl, vl = self.layer_kv(layer)
        slots = self.slots_for(layer, slots)
        fmt = self.layer_format(layer)
        kl.index_copy_(1, slots, fmt.encode(k.transpose(0, 1), keys_of=layer))
        vl.index_copy_(1, slots, fmt.encode(v).transpose(0, 1))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``slots`` (1-D) as ``[num_kv_heads, n, head_dim]`` scratch views, in the
        model's dtype (decoded from int8; keys in the model's channel order)."""
        heads, n, dim = self.shape.num_kv_heads, slots.numel(), self.shape.head_dim
        if self.layer_format(layer).quantized:
            kl, vl = self.layer_kv(layer)
            slots = self.slots_for(layer, slots)
            return tuple(self.format.decode(t.index_select(1, slots), dim, self.shape.dtype,
                                            layer if t is kl else None)
                         for t in (kl, vl))  # fmt: skip
        need = 2 * heads * n * dim
        if self._scratch.numel() < need:  # grow-only: allocation (and page faults) once
            self._scratch = torch.empty(max(need, 2 * self._scratch.numel()),
                                        dtype=self.shape.dtype, device=self.device)  # fmt: skip
        k = self._scratch[: need // 2].view(heads, n, dim)
        v = self._scratch[need // 2 : need].view(heads, n, dim)
        kl, vl = self.layer_kv(layer)
        slots = self.slots_for(layer, slots)
        torch.index_select(kl, 1, slots, out=k)
        torch.index_select(vl, 1, slots, out=v)
        return k, v

    def nbytes(self) -> int:
        """Bytes of the KV storage (pad slots aside)."""
        window = len(self.shape.window_layers) if self.windowed else 0
        per_slot = self.shape.bytes_per_token() - window * self.shape.layer_bytes()
        return self.num_slots * per_slot + self.window_slots * window * self.shape.layer_bytes()
