"""Paged latent KV cache: the device array and its host bookkeeping.

One array ``[layers, num_pages, page_size, row]`` (row = 576 = [c 512 | k_pe 64] bf16 for MLA), so the
DDTree commit moves every layer in one launch; ``layer(i)`` is the ``[num_pages, page_size, row]``
view the attention kernel reads. Pages are handed to sequences from a free list; a sequence's page
list is its page table. Position p of a sequence lives at slot ``pages[p // page_size] * page_size +
p % page_size`` of every layer.
"""

from __future__ import annotations

import numpy as np

# Unused page-table entries: far outside any cache, so a kernel bug that reads one faults or
# shows up as garbage instead of silently reading another sequence's rows.
PAGE_SENTINEL = np.iinfo(np.int32).max


class CacheFullError(RuntimeError):
    """Not enough free pages for a reservation (nothing was allocated)."""


class PageAllocator:
    """The one owner of a run's KV pages. Every cache a request has (the target's latent cache, a
    drafter's context cache) is an array of the same ``num_pages`` pages and indexes them through
    this allocator's page lists, so position p of a sequence is the same slot in all of them.

    Two counts: pages *held* (handed out by ``reserve``, returned by ``trim`` / ``free``) and pages
    *promised* (``promise``: the most a sequence will ever hold, reserved at admission). Admission
    only promises what is free of promises, so a later ``reserve`` within a promise never fails and
    nothing is ever preempted, while ``trim`` still hands rejected tree rows' pages back at once."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
        if num_pages * page_size >= 2**31:
            raise ValueError(f"{num_pages} pages of {page_size} rows: slots must fit int32")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low page ids first
        self._pages: dict[object, list[int]] = {}
        self._promised: dict[object, int] = {}

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_promised_pages(self) -> int:
        return sum(self._promised.values())

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_promise(self, num_tokens: int) -> bool:
        return self.num_promised_pages + self.pages_for(num_tokens) <= self.num_pages

    def promise(self, seq_id, num_tokens: int) -> None:
        """Admit ``seq_id`` for at most ``num_tokens`` positions (raises CacheFullError if the
        promises would exceed the cache)."""
        if not self.can_promise(num_tokens):
            raise CacheFullError(f"sequence {seq_id!r}: {self.pages_for(num_tokens)} pages for {num_tokens} tokens "
                                 f"do not fit beside {self.num_promised_pages} promised of {self.num_pages}")
        self._promised[seq_id] = self.pages_for(num_tokens)

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._pages

    def _seq(self, seq_id) -> list[int]:
        try:
            return self._pages[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id!r} has no pages in this cache") from None

    def capacity(self, seq_id) -> int:
        """Positions the sequence can hold now."""
        return len(self._seq(seq_id)) * self.page_size

    def pages(self, seq_id) -> list[int]:
        return list(self._seq(seq_id))

    def reserve(self, seq_id, num_tokens: int) -> None:
        """Make room for positions 0 .. num_tokens-1 of ``seq_id`` (new sequences included); all or
        nothing: raises CacheFullError without allocating when pages run short."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        have = self._pages.get(seq_id, [])
        more = self.pages_for(num_tokens) - len(have)
        promised = self._promised.get(seq_id)
        if promised is not None and len(have) + more > promised:
            raise CacheFullError(f"sequence {seq_id!r} needs {len(have) + more} pages for {num_tokens} tokens, "
                                 f"beyond the {promised} promised at admission")
        if more > len(self._free):
            raise CacheFullError(f"sequence {seq_id!r} needs {more} more pages for {num_tokens} tokens; "
                                 f"{len(self._free)} of {self.num_pages} are free")
        self._pages[seq_id] = have + [self._free.pop() for _ in range(max(more, 0))]

    def trim(self, seq_id, num_tokens: int) -> None:
        """Return the pages past position num_tokens-1 (e.g. rejected tree rows after a commit)."""
        pages = self._seq(seq_id)
        keep = self.pages_for(num_tokens)
        while len(pages) > keep:
            self._free.append(pages.pop())

    def free(self, seq_id) -> None:
        """Return every page of ``seq_id``, and its promise, and forget it."""
        self._free.extend(reversed(self._pages.pop(seq_id, [])))
        self._promised.pop(seq_id, None)

    # -- metadata for the kernels --------------------------------------------------------------
    def slots(self, seq_id, positions) -> np.ndarray:
        """int32 slots of ``positions`` (within the sequence's capacity)."""
        pages = np.asarray(self._seq(seq_id), dtype=np.int64)
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (pos.min() < 0 or pos.max() >= len(pages) * self.page_size):
            raise ValueError(f"sequence {seq_id!r}: positions {int(pos.min())}..{int(pos.max())} outside "
                             f"its capacity {len(pages) * self.page_size}")
        return (pages[pos // self.page_size] * self.page_size + pos % self.page_size).astype(np.int32)

    def page_table(self, seq_ids, width: int | None = None) -> np.ndarray:
        """int32 [len(seq_ids), width]: each sequence's pages, then PAGE_SENTINEL."""
        lists = [self._seq(s) for s in seq_ids]
        need = max((len(p) for p in lists), default=0)
        width = need if width is None else width
        if width < need:
            raise ValueError(f"page table width {width} < {need} pages held by a sequence")
        table = np.full((len(lists), max(width, 1)), PAGE_SENTINEL, dtype=np.int32)
        for i, p in enumerate(lists):
            table[i, :len(p)] = p
        return table


class PagedKVCache:
    """One device array of pages. Its bookkeeping is ``allocator``, a PageAllocator of its own or
    shared (``allocator=``) with the other caches of the same requests: sequences reserve, trim and
    free pages there, and slots and page tables come from there."""

    def __init__(self, backend, num_layers: int, num_pages: int, page_size: int, row: int = 576,
                 allocator: PageAllocator | None = None):
        if min(num_layers, num_pages, page_size, row) < 1:
            raise ValueError(f"num_layers, num_pages, page_size, row must be >= 1, got "
                             f"{num_layers}, {num_pages}, {page_size}, {row}")
        if allocator is None:
            allocator = PageAllocator(num_pages, page_size)
        elif (allocator.num_pages, allocator.page_size) != (num_pages, page_size):
            raise ValueError(f"cache of {num_pages} pages x {page_size} rows cannot share an allocator of "
                             f"{allocator.num_pages} x {allocator.page_size}")
        self.backend, self.allocator = backend, allocator
        self.num_layers, self.num_pages, self.page_size, self.row = num_layers, num_pages, page_size, row
        self.data = backend.zeros((num_layers, num_pages, page_size, row), "bf16")

    def __repr__(self) -> str:
        return (f"PagedKVCache({self.num_layers} layers x {self.num_pages} pages x {self.page_size} rows x "
                f"{self.row}, {self.allocator.num_free_pages} free, {len(self.allocator._pages)} sequences)")

    # -- device work ---------------------------------------------------------------------------
    def layer(self, i: int):
        """``[num_pages, page_size, row]`` view of layer i."""
        return self.data[i]

    def write(self, layer: int, rows, slots):
        """Store ``rows [n, row]`` at ``slots`` (int32, backend array) of one layer."""
        return self.backend.kv_cache_write(self.data[layer], rows, slots)

    def commit(self, page_table, prefix_lens, accepted, num_accepted):
        """DDTree commit on every layer at once (see kv_cache_commit)."""
        return self.backend.kv_cache_commit(self.data, page_table, prefix_lens, accepted, num_accepted)
