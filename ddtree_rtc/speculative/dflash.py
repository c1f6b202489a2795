"""The DFlash drafter behind the round's Drafter interface (docs/architecture.md, "The DFlash
drafter"): its context K/V live in two paged caches (K, V) that share the engine's PageAllocator,
so context row p of a request is the slot of the target's position p. Prefill (``admit``) writes
the prompt's rows; each round's ``extend_context`` writes the root and the accepted nodes; the
block's own K/V is never stored. ``window``: attend only the last ``window`` context rows."""

from __future__ import annotations

import numpy as np

from ..engine.kv_cache import PagedKVCache
from .drafters import Drafter


class DFlashDrafter(Drafter):
    name = "dflash"

    def __init__(self, model, window: int | None = None):
        c = model.cfg
        self.model, self.backend, self.window = model, model.backend, window
        self.depth, self.vocab_size = c.depth, c.vocab_size
        self.target_layer_ids = tuple(c.target_layer_ids)
        self.k = self.v = self.alloc = None
        self._ctx: dict = {}  # rid -> context rows written

    @classmethod
    def load(cls, directory, target, window: int | None = None) -> DFlashDrafter:
        from ..model.dflash import DFlashModel

        return cls(DFlashModel.load(directory, target), window)

    def attach(self, allocator) -> None:
        c = self.model.cfg
        row = self.model.kv_heads * c.head_dim  # this rank's kv heads
        self.alloc = allocator
        self.k, self.v = (PagedKVCache(self.backend, c.num_hidden_layers, allocator.num_pages, allocator.page_size,
                                       row, allocator) for _ in range(2))

    def _write(self, rids, hidden, counts) -> None:
        if self.alloc is None:
            raise RuntimeError("DFlash drafter: attach(allocator) before use (Engine does it)")
        be = self.backend
        spans = [np.arange(self._ctx.get(r, 0), self._ctx.get(r, 0) + int(n)) for r, n in zip(rids, counts)]
        pos = np.concatenate(spans)
        slots = np.concatenate([self.alloc.slots(r, p) for r, p in zip(rids, spans)]).astype(np.int32)
        d_slots = be.asarray(slots)
        for i, (k, v) in enumerate(self.model.context_kv(hidden, be.asarray(pos.astype(np.int32)))):
            self.k.write(i, k, d_slots)
            self.v.write(i, v, d_slots)
        for r, n in zip(rids, counts):
            self._ctx[r] = self._ctx.get(r, 0) + int(n)

    def admit(self, rid, prompt, hidden) -> None:
        self._ctx[rid] = 0
        self._write([rid], hidden, [len(prompt)])

    def extend_context(self, rids, hidden, counts) -> None:
        self._write(rids, hidden, counts)

    def draft(self, rids, roots, prefix_lens):
        be, c = self.backend, self.model.cfg
        lens = np.array([self._ctx[r] for r in rids], np.int32)
        if not np.array_equal(lens, np.asarray(prefix_lens)):
            raise RuntimeError(f"DFlash drafter: context rows {lens.tolist()} != committed prefixes "
                               f"{np.asarray(prefix_lens).tolist()}")
        bs = c.block_size
        tokens = np.full((len(rids), bs), c.mask_token_id, np.int32)
        tokens[:, 0] = roots
        positions = (np.asarray(prefix_lens, np.int32)[:, None] + np.arange(bs, dtype=np.int32)).reshape(-1)
        starts = np.zeros_like(lens) if self.window is None else np.maximum(lens - self.window, 0).astype(np.int32)
        pt = self.alloc.page_table(rids)
        layers = range(c.num_hidden_layers)
        logits, _ = self.model.block_forward(
            be.asarray(tokens.reshape(-1)), be.asarray(positions), [self.k.layer(i) for i in layers],
            [self.v.layer(i) for i in layers], be.asarray(pt), be.asarray(lens), be.asarray(starts),
            whole=self.model.target.shard.world == 1)  # on several ranks, this rank's vocabulary slice
        # (the round's top-k merges the slices' (value, id) pairs)
        return logits

    def release(self, rid) -> None:
        self._ctx.pop(rid, None)
