"""Prefix reuse: what the engine's free slots hold, where a later request can resume, and which
slot a request takes.

A finished request leaves in its slot the keys and values of every token the slot processed: its
prompt and the output tokens a decode step fed (`Engine` counts them; the last sampled token is
fed only where a pipelined step was already launched when it turned out to be the last). Those
tokens are `held[b]`; positions past them are written by later steps of other slots and never
read. A request whose prompt starts with some of them takes that slot and prefills from there.

- Attention alone (every per-slot state is a key, a value or an indexer key, one per position):
  any common prefix is a resume point: the slot's rows [0, n) are exactly what a cold prefill of
  those n tokens writes.
- A model with recurrent layers (gated delta nets, Mamba-2, lightning attention, short
  convolutions, n-gram contexts): the slot's recurrent state covers all its tokens and nothing
  less, and a free slot's state is advanced by every later decode step (a step runs every slot).
  So the state is copied out (`cupool.slotstate.SavedStates`) at the points a later request can
  resume from: the end of the prompt (after its prefill; a follow-up that keeps the prompt but not
  the answer resumes there), the end of the request (right after the last step that fed one of its
  tokens), and, where the request names one (`resume_at`, the server's end of the conversation
  before the generation prompt), that position inside the prompt: the prefill ends a chunk there
  and copies the state out before running on. The last matters for chat templates whose
  generation prompt opens a thinking block that the next turn's rendering drops: the next turn
  keeps neither the prompt nor the answer, but it keeps the conversation before them. A request
  resumes at the longest such point that is a prefix of its prompt; a prompt that diverges before
  every point of every slot is prefilled from the start.

Bounds: the slots themselves (a request that matches no slot takes the free slot least worth
keeping: one with nothing to resume first, then the least recently used), and for recurrent states
`points` saved entries of one slot's states each (`SavedStates.entry_bytes`, allocated all at once
on the first save); when every entry is taken, saving a new point drops the least recently saved
one, whichever slot holds it (three points a slot at most, so the engine's default is
3 × slots). The last prompt token is always prefilled (its logits give the first token), so a
request resumes at most at its prompt's length − 1.
"""

from __future__ import annotations

import dataclasses
import itertools

from cupool.slotstate import SavedStates, StateSlotCache


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists (a binary search over slice equality:
    list comparisons run in C, which matters for prompts of many thousand tokens; a prompt that
    extends `a` is settled by the first comparison)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclasses.dataclass
class Point:
    """A resume point of a slot: the slot's state after its first `length` tokens, in `entry`."""
    length: int
    entry: int
    saved_at: int


class PrefixCache:
    """The engine's prefix bookkeeping for `slots` slots of `cache` (see the module docstring).

    enabled: reuse at all (else every request takes the least recently used free slot, start 0).
    points: saved recurrent states (resume points) kept at most; 0 disables reuse for models with
        recurrent layers.
    resumable: whether the model's layers can continue a multi-token prefill from a state (False
        for a model whose prompts are prefilled in one forward): else no resume points are kept.
    """

    def __init__(self, cache: StateSlotCache, slots: int, *, enabled: bool = True,
                 points: int = 0, resumable: bool = True):
        self.enabled = bool(enabled)
        self.saved = SavedStates(cache, points if enabled and resumable else 0)
        self.held: list[list[int] | None] = [None] * slots    # tokens a free slot's rows hold
        self.points: list[list[Point]] = [[] for _ in range(slots)]
        self._free_entries = list(range(self.saved.count - 1, -1, -1))
        self._last_use = [0] * slots
        self._clock = itertools.count(1)
        self._prefilled = False          # a prefill has run (whether states exist is known)

    def stateful(self) -> bool:
        """Whether the slots hold recurrent states (known after the first prefill)."""
        return bool(self.saved.states())

    # --- admission ---------------------------------------------------------------------------------
    def take(self, prompt: list[int], free: list[int]) -> tuple[int, int, int | None]:
        """(slot, positions to reuse, saved entry to load into the slot or None) for a request
        with `prompt`, among the `free` slots. The slot's points are given up (its rows and
        states will be the new request's), the entry to load stays valid until the next save."""
        best, start, entry = None, 0, None
        if self.enabled:
            stateful = self.stateful()
            for b in free:
                held = self.held[b]
                if not held:
                    continue
                n = min(common_prefix(held, prompt), len(prompt) - 1)
                e = None
                if stateful:
                    fit = [p for p in self.points[b] if p.length <= n]
                    if not fit:
                        continue
                    p = max(fit, key=lambda p: p.length)
                    n, e = p.length, p.entry
                if n > start:
                    best, start, entry = b, n, e
        if best is None:
            best = min(free, key=lambda b: (self._keeps(b), self._last_use[b]))
        self.drop(best)
        self._last_use[best] = next(self._clock)
        return best, start, entry

    def _keeps(self, b: int) -> bool:
        """Whether free slot b holds something a later request could resume from."""
        if self.held[b] is None:
            return False
        return bool(self.points[b]) if self.stateful() else True

    def point_in_prompt(self, resume_at: int | None, start: int, prompt_len: int) -> int | None:
        """Where the prefill of a prompt of `prompt_len` tokens, run from `start`, saves the
        request's `resume_at` point (None: nowhere). The prefill ends a chunk there and calls
        `keep_point` (at `start` itself: before its first chunk, the slot holding the loaded
        point's state). Nowhere where no state would be kept: reuse off, no entries, a model of
        attention alone (known from the first prefill on; before it, the point is taken, and
        `keep_point` keeps nothing if no state exists), a point at 0 or inside the reused
        positions (no state of it exists), or at the prompt's end (the end-of-prompt point)."""
        if resume_at is None or not self.enabled or self.saved.count == 0:
            return None
        if self._prefilled and not self.stateful():
            return None
        return resume_at if 0 < resume_at < prompt_len and resume_at >= start else None

    def keep_point(self, slot: int, length: int) -> None:
        """The slot's prefill has run exactly the prompt's first `length` tokens: keep its state
        as a point (`point_in_prompt` said where)."""
        if self.enabled and self.stateful():
            self._save(slot, length)

    def prompt_done(self, slot: int, prompt_len: int) -> None:
        """The slot's prompt has been prefilled: keep its state as the end-of-prompt point."""
        self._prefilled = True
        if self.enabled and self.stateful():
            self._save(slot, prompt_len)

    def release(self, slot: int, tokens: list[int] | None) -> None:
        """The slot's request is done; its rows (and states) hold `tokens` (None: nothing reliable,
        e.g. after an error). Keeps the end-of-request point of a model with recurrent states."""
        if tokens is None or not self.enabled:
            self.drop(slot)
            return
        self.held[slot] = tokens
        if self.stateful():
            self._save(slot, len(tokens))

    def drop(self, slot: int) -> None:
        """Forget what slot `slot` holds (its points' entries become free)."""
        self.held[slot] = None
        for p in self.points[slot]:
            self._free_entries.append(p.entry)
        self.points[slot] = []

    # --- saved states ----------------------------------------------------------------------------
    def _save(self, slot: int, length: int) -> None:
        """Copy the slot's states out as its point at `length` (once: a point the slot already
        has is the same state)."""
        if any(p.length == length for p in self.points[slot]):
            return
        entry = self._entry()
        if entry is None:
            return
        self.saved.save(slot, entry)
        self.points[slot].append(Point(length, entry, next(self._clock)))

    def _entry(self) -> int | None:
        """A free entry, else the least recently saved point's (that point is dropped)."""
        if self._free_entries:
            return self._free_entries.pop()
        owned = [(p.saved_at, b, p) for b, pts in enumerate(self.points) for p in pts]
        if not owned:
            return None                       # no entries at all (points=0)
        _, b, p = min(owned, key=lambda x: x[0])
        self.points[b].remove(p)
        return p.entry

    def close(self) -> None:
        self.held = [None] * len(self.held)
        self.points = [[] for _ in self.held]
        self._free_entries = list(range(self.saved.count - 1, -1, -1))
        self.saved.release()

    def memory_bytes(self) -> int:
        """Bytes of the saved states allocated so far (0 for attention alone)."""
        return self.saved.allocated_bytes()
