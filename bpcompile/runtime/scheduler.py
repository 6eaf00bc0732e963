"""Admission: which requests run in the next step.

FIFO into a running batch of at most max_batch_size requests. A request's worst-case KV pages (prompt +
max_tokens + one tree) are reserved when it is admitted, so a running request never runs out of cache and
nothing is ever preempted; a request that does not fit waits until others finish. Pages a request shares with
others (prefix reuse, `PagedKV`) count in its reservation as if they were its own: what running requests
reference never exceeds what they reserved, so a new page is always free or a cached one nobody references."""

from __future__ import annotations

from collections import deque
from typing import Optional

from bpcompile.runtime.request import Request


class Scheduler:
    def __init__(self, max_batch_size: int, capacity: int):
        self.max_batch_size, self.capacity = max_batch_size, capacity
        self.waiting: deque[Request] = deque()
        self.waiting_ids: set[str] = set()
        self.running: dict[str, Request] = {}
        self.reserved = 0  # pages reserved by running requests

    def __contains__(self, rid: str) -> bool:
        return rid in self.running or rid in self.waiting_ids

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, r: Request) -> None:
        self.waiting.append(r)
        self.waiting_ids.add(r.id)

    def admit(self) -> list[Request]:
        """Move waiting requests into the running batch while the batch and the cache have room."""
        new = []
        while (
            self.waiting
            and len(self.running) < self.max_batch_size
            and self.reserved + self.waiting[0].pages <= self.capacity
        ):
            r = self.waiting.popleft()
            self.waiting_ids.discard(r.id)
            self.reserved += r.pages
            self.running[r.id] = r
            new.append(r)
        return new

    def pages_of(self, rid: str) -> int:
        """Worst-case KV pages reserved (running) or to be reserved (waiting) for request rid."""
        r = self.running.get(rid) or next((r for r in self.waiting if r.id == rid), None)
        return r.pages if r is not None else 0

    def drop_waiting(self, rid: str) -> Optional[Request]:
        if rid not in self.waiting_ids:
            return None
        r = next(r for r in self.waiting if r.id == rid)
        self.waiting.remove(r)
        self.waiting_ids.discard(rid)
        return r

    def finish(self, r: Request) -> None:
        """A running request is done (finished or cancelled): its reservation is returned."""
        if self.running.pop(r.id, None) is not None:
            self.reserved -= r.pages
