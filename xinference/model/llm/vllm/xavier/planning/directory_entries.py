"""One copy of a block as the block directory keeps it (pure): a single int.

At 64 replicas the directory holds millions of copies, so each is one Python int that
packs the block's full 192-bit name and its :class:`~.directory_types.Location`
(:func:`pack`), instead of a tuple of tuples in three dicts (~830 B per copy, issue #36).
The directory keeps each entry object twice, by reference:

* under the block's *short name* (:func:`short_name`: the low 63 bits of its name, what a
  load row carries, and its group) in a **record**: the entry itself, or a tuple of the
  entries that share the short name (other holders; in a collision, other names);
* under its *place* on its rank (:func:`place_of`: tier, group, slot), which is the truth:
  an entry that is not its rank's entry at its place any more (the slot was reused, the
  rank went) is garbage in its record, skipped by every lookup (an identity test, ``is``)
  and removed when found or swept.

Fields, low bits first: incarnation (64), generation (64), slot (32), group (16),
tier (8), 8 unused, rank (16), name (192): :data:`ENTRY_DTYPE`.
"""

from __future__ import annotations

import operator
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np

from .block_names import ROW_KEY_MASK
from .directory_types import Location
from .load_batch import Tier, read_preference

#: an entry's fields, low bits first, each on whole bytes: :data:`ENTRY_DTYPE` reads a
#: query's chosen entries in one go (:func:`location_table`)
ENTRY_DTYPE = np.dtype([("incarnation", "<u8"), ("generation", "<u8"), ("slot", "<u4"),
                        ("group", "<u2"), ("tier", "u1"), ("pad", "u1"), ("rank", "<u2"),
                        ("name", "V24")])
_GEN, _SLOT, _GROUP, _TIER, _RANK, _NAME = 64, 128, 160, 176, 192, 208
#: for the directory's loops, which pack and unpack inline (a call per field cost ~40 %)
NAME_SHIFT, RANK_SHIFT, TIER_SHIFT, PLACE_SHIFT, GEN_SHIFT = _NAME, _RANK, _TIER, _SLOT, _GEN
#: a place's fields (:func:`place`), inline
PLACE_TIER_SHIFT, PLACE_GROUP_SHIFT = _TIER - _SLOT, _GROUP - _SLOT
#: the largest value each field takes (``register`` refuses larger ones, naming the field;
#: generations and incarnations fit the int64 table of a query's answer)
LIMITS = {"rank": (1 << 16) - 1, "tier": (1 << 8) - 1, "group": (1 << 16) - 1,
          "slot": (1 << 32) - 1, "generation": (1 << 63) - 1, "incarnation": (1 << 63) - 1,
          "key": (1 << 192) - 1}
_M64 = (1 << 64) - 1
#: a place (:func:`place`) is bits 128..191 of an entry: slot, group, tier
PLACE_MASK = _M64

class DirectoryError(ValueError):
    """Bad input to the directory; the message names the field."""


#: a record: one entry, or the entries sharing one short name (device copies first)
Record = Union[int, Tuple[int, ...]]


def pack(key: int, rank: int, tier: int, group: int, slot: int, generation: int,
         incarnation: int) -> int:
    """The entry of block ``key``'s copy at ``(rank, tier, group, slot)``."""
    return ((key << _NAME) | (rank << _RANK) | (tier << _TIER) | (group << _GROUP)
            | (slot << _SLOT) | (generation << _GEN) | incarnation)


def place(tier: int, group: int, slot: int) -> int:
    """A slot's place on its rank: what :func:`place_of` gives for its entries."""
    return (tier << (_TIER - _SLOT)) | (group << (_GROUP - _SLOT)) | slot


def short_name(key: int, group: int) -> int:
    """Where block ``key`` of ``group`` is recorded: its low 63 bits and its group."""
    return ((key & ROW_KEY_MASK) << 16) | group


def name_of(entry: int) -> int:
    return entry >> _NAME


def rank_of(entry: int) -> int:
    return (entry >> _RANK) & 0xFFFF


def group_of(entry: int) -> int:
    return (entry >> _GROUP) & 0xFFFF


def tier_of(entry: int) -> int:
    return (entry >> _TIER) & 0xFF


def place_of(entry: int) -> int:
    return (entry >> _SLOT) & _M64


def tier_of_place(place_: int) -> int:
    return place_ >> (_TIER - _SLOT)


def identity_of(entry: int) -> Tuple[int, int]:
    """(generation, incarnation)."""
    return (entry >> _GEN) & _M64, entry & _M64


def location_of(entry: int) -> Location:
    return Location(rank_of(entry), tier_of(entry), group_of(entry),
                    (entry >> _SLOT) & 0xFFFFFFFF, (entry >> _GEN) & _M64, entry & _M64)


def location_table(chosen: Sequence[int]) -> np.ndarray:
    """The :class:`~.directory_types.QueryResult` table of entries ``chosen``: one int64
    row of :class:`Location` fields each, read from their bytes (no per-field Python)."""
    size = ENTRY_DTYPE.itemsize
    rows = np.frombuffer(b"".join(e.to_bytes(size, "little") for e in chosen), ENTRY_DTYPE)
    table = np.empty((len(rows), len(Location._fields)), np.int64)
    for column, name in enumerate(Location._fields):
        table[:, column] = rows[name]
    return table


def entries(record: Record) -> Tuple[int, ...]:
    return (record,) if isinstance(record, int) else record


def with_entry(record: Record | None, entry: int, device: bool) -> Record:
    """``record`` and ``entry``, last of its kind: device copies before host copies (a
    lookup weighs only the first few), each in the order registered."""
    if record is None:
        return entry
    held = entries(record)
    if not device:
        return held + (entry,)
    at = next((i for i, e in enumerate(held) if read_preference(tier_of(e))), len(held))
    return held[:at] + (entry,) + held[at:]


def without_entry(record: Record, entry: int) -> Record | None:
    """``record`` less the entry object ``entry`` (by identity: an equal entry registered
    again after its rank came back is another object and stays); None when empty."""
    if record is entry:
        return None
    if isinstance(record, int):
        return record
    left = tuple(e for e in record if e is not entry)
    return None if not left else left[0] if len(left) == 1 else left


def check_entry(group: object, key: object, tier: object, slot: object, gen: object) -> None:
    """Raise naming the first bad field of a registered entry (none: it is good, e.g. a
    ``Tier`` member as its tier)."""
    check_int("group", group, LIMITS["group"])
    check_int("key", key, LIMITS["key"])
    Tier(check_int("tier", tier))
    check_int("slot", slot, LIMITS["slot"])
    check_int("generation", gen, LIMITS["generation"])


def checked_places(tier: object, group: object, slots: Sequence[object]) -> List[int]:
    """``slots`` as ints, their place's fields in range (else another slot's place would be
    named); numpy's ints are ints here."""
    Tier(check_int("tier", _as_int(tier)))
    check_int("group", _as_int(group), LIMITS["group"])
    s_max = LIMITS["slot"]
    plain = [slot for slot in slots if type(slot) is int and 0 <= slot <= s_max]
    if len(plain) == len(slots):  # (the common case, without a call per slot)
        return plain
    return [check_int("slot", _as_int(slot), s_max) for slot in slots]


def _as_int(value: object) -> object:
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return value  # (refused by check_int, naming it)


def check_int(name: str, value: object, limit: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DirectoryError(f"{name}: expected a non-negative int, got {value!r}")
    if limit is not None and value > limit:
        raise DirectoryError(f"{name}: at most {limit}, got {value}")
    return value
