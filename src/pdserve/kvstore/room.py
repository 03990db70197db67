"""How the KV store makes room in RAM: which entries to spill to disk or drop, LRU first.

``plan_room`` only plans; ``KVStore`` carries the plan out, or, when there is none, refuses
the write (``CapacityError``). The rules (``kvstore.store``'s module docstring):

* only unpinned RAM entries move (nobody reads or writes them), least recently used first;
* an entry spills to disk if the disk tier has room for it, made if need be by dropping the
  least recently used cache entries already on disk;
* a cache entry that cannot spill is dropped; a hand-off is never dropped to make room.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from pdserve.kvstore.disk import DiskTier
from pdserve.kvstore.entry import Tier, _Entry

Action = Literal["spill", "drop"]


def plan_room(
    entries: Iterable[_Entry],
    need: int,
    disk: DiskTier | None,
    replacing: _Entry | None = None,
    keep: _Entry | None = None,
) -> list[tuple[Action, _Entry]] | None:
    """The spills and drops that free ``need`` bytes of RAM, in order; None if none do.

    ``entries``: every live entry, least recently used first. ``replacing``: the entry the
    write will replace (its room is counted in ``need`` already; it is not moved). ``keep``:
    the spilled entry being reloaded (never dropped; its file's room counts as free).
    """
    entries = list(entries)
    plan: list[tuple[Action, _Entry]] = []
    if need <= 0:
        return plan
    disk_free = disk.free_bytes() + (keep.size if keep is not None else 0) if disk else 0
    droppable = [e for e in entries if e.tier is Tier.DISK and e.cache and e is not keep]
    for victim in entries:
        if need <= 0:
            break
        if victim.tier is not Tier.RAM or victim.refs or victim in (replacing, keep):
            continue
        if disk is not None and victim.size <= disk.capacity_bytes:
            freed, drops = disk_free, 0
            while freed < victim.size and drops < len(droppable):
                freed += droppable[drops].size
                drops += 1
            if freed >= victim.size:
                plan += [("drop", d) for d in droppable[:drops]]
                del droppable[:drops]
                plan.append(("spill", victim))
                disk_free = freed - victim.size
                need -= victim.size
                continue
        if victim.cache:
            plan.append(("drop", victim))
            need -= victim.size
    return plan if need <= 0 else None
