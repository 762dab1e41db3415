"""The host index: which blocks of vLLM's own cache a worker published, in a file that the
schedulers of the other replicas of this host read without asking anyone (issue #34).

A lookup through the block directory is a round trip to the supervisor (2.4 ms at C1 on
the H200, 31.5 ms at C32 with the queueing in its one actor) on every hit's path to its
first token.  For a holder on the same host the answer is already in memory this host
shares: each worker that publishes blocks in place (:mod:`..planning.in_place`) also
writes them here, after the forward that computed them completed (the publisher thread,
:class:`HostIndexLink`, the same moment as its directory registration), and a scheduler
probes its peers' files inside ``get_num_new_matched_tokens``
(:class:`~.host_holders.HostHolders`).

Nothing here is trusted for the bytes.  A hit found here is a ``Tier.VLLM`` location like
the directory's (rank, group, vLLM block id, generation, the engine's incarnation), read
and checked after its copy exactly like one (``doc/validated-reads.md``): an entry that
lags (its block handed out again) is a failed read, recomputed.  To keep that rare a probe
already compares each entry's generation with the source's block generations (the file
the source's scheduler bumps before vLLM can write a block), so an entry whose block was
handed out since it was written is a miss at once.

The file (``int64`` words, owner-locked like every Xavier file of ``/dev/shm``): a header
of :data:`HEADER_WORDS`, then ``buckets`` buckets of :data:`WAYS` entries of
:data:`ENTRY_WORDS` words (one 64-byte line each)::

    name (3 words: the 192-bit block name) | group << 32 | block | generation |
    incarnation | stamp (insertion order) | check

One writer (the worker's publisher thread); readers in other processes never lock.  An
entry read while it is being written is caught by its ``check`` (a keyed mix of the other
seven words: a torn entry -- one entry's name with another's block -- passes with odds
2**-64), so no memory-ordering argument is needed.  A bucket that is full overwrites its
entry whose block moved on (generation changed) or else its oldest: a lost entry is only a
directory lookup.  Memory: 64 bytes per entry, twice as many entries as vLLM has blocks and
Xavier's tiers may hold, rounded up to a power of two buckets (e.g. 32 MiB for 200k).
"""

from __future__ import annotations

import os
import secrets
import stat
import time
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from ..planning.directory_link import DirectoryLink, Entry
from ..planning.load_batch import Tier
from ..planning.log_names import package_logger
from ..planning.shm_words import DATA_NAME, ShmWords, shm_dir
from .slot_generations import SlotGenerations

logger = package_logger(__name__)

#: first word of the file: what it is (and its format's version): "XAVIDX", 1
FORMAT = 0x58415649_4458_0001
HEADER_WORDS = 32
ENTRY_WORDS = 8
WAYS = 8
#: header words: format, buckets, salt, rank, tp_rank, the generations file's incarnation,
#: its first word and blocks, the insertion stamp, then the generations file's path
_BUCKETS, _SALT, _RANK, _TP_RANK, _GEN_INC, _GEN_FIRST, _NUM_BLOCKS, _STAMP = range(1, 9)
_PATH_WORD, _PATH_BYTES = 12, 8 * (HEADER_WORDS - 12)
#: entry words
_BLOCK, _GENERATION, _INCARNATION, _ESTAMP, _CHECK = 3, 4, 5, 6, 7
_U64 = np.uint64
_MIX = _U64(0x9E3779B97F4A7C15)
_LOW32 = _U64(0xFFFFFFFF)
#: how often a worker that publishes tells the directory again where its index is
ANNOUNCE_PERIOD_S = 5.0
#: the most tier blocks an index makes room for (64 MiB of entries)
MAX_TIER_ENTRIES = 1 << 19
#: entries per directory call of a republication (:meth:`HostIndexLink.republish`)
REPUBLISH_CHUNK = 4096
#: at most this many rounds per insert call (entries of one call that collide in a bucket
#: wait for the next round; what is left after them is dropped: only a directory lookup)
_MAX_ROUNDS = 16


def name_words(names: Sequence[int]) -> np.ndarray:
    """``names`` (192-bit ints) as rows of three ``uint64`` words, low word first."""
    data = b"".join(int(n).to_bytes(24, "little") for n in names)
    return np.frombuffer(data, dtype="<u8").astype(_U64).reshape(-1, 3)


def _mix(words: np.ndarray, salt: int) -> np.ndarray:
    """The check word of entries ``words`` (``(..., 7)`` uint64), never 0 (0: empty)."""
    h = np.full(words.shape[:-1], _U64(salt), _U64)
    with np.errstate(over="ignore"):
        for i in range(words.shape[-1]):
            h ^= words[..., i]
            h *= _MIX
            h ^= h >> _U64(31)
    return h | _U64(1)


def _buckets_of(first_words: np.ndarray, groups: np.ndarray, mask: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        return ((first_words ^ (groups.astype(_U64) * _MIX)) & _U64(mask)).astype(np.int64)


def _check_path(path: str) -> None:
    """``path`` names an Xavier file of :func:`~..planning.shm_words.shm_dir` (else an
    error naming it)."""
    if (not DATA_NAME.match(os.path.basename(path))
            or os.path.dirname(os.path.abspath(path)) != os.path.abspath(shm_dir())
            or os.path.islink(path)):
        raise ValueError(f"host index: {path!r} is not an Xavier shared-memory file")


class HostIndex:
    """One worker's host index file (module docstring): :meth:`create` (the owner, who
    :meth:`insert` s), :meth:`open` (a reader, who :meth:`find` s)."""

    def __init__(self, shm: ShmWords, generations: np.ndarray,
                 own_generations: Optional[SlotGenerations] = None) -> None:
        self._shm = shm
        self.path = shm.path
        header = shm.words[:HEADER_WORDS]
        self.rank, self.tp_rank = int(header[_RANK]), int(header[_TP_RANK])
        self.incarnation = int(header[_GEN_INC])
        self.num_blocks = int(header[_NUM_BLOCKS])
        self._salt = int(header[_SALT])
        buckets = int(header[_BUCKETS])
        self._mask = buckets - 1
        self._table = shm.words[HEADER_WORDS:].view(_U64).reshape(buckets, WAYS, ENTRY_WORDS)
        self._generations = generations  # the source engine's block generations
        self._own_generations = own_generations  # a reader's mapping of them (it closes it)
        self.inserted = self.dropped = 0

    @classmethod
    def create(cls, rank: int, tp_rank: int, generations: SlotGenerations, row: np.ndarray,
               directory: Optional[str] = None, tier_blocks: int = 0) -> HostIndex:
        """A new file for the engine whose block generations are ``generations`` (row
        ``row``: one word per vLLM block), room for twice its blocks and the ``tier_blocks``
        its Xavier tiers may hold (at most :data:`MAX_TIER_ENTRIES`): an entry whose block
        was handed out -- saved into a tier, maybe -- stays about as long as a tier keeps
        a block, so that a peer's probe still finds it "seen" (:mod:`.host_holders`)."""
        num_blocks = len(row)
        room = 2 * (num_blocks + min(max(0, int(tier_blocks)), MAX_TIER_ENTRIES))
        buckets = 1 << max(0, int(np.ceil(np.log2(max(1, room) / WAYS))))
        shm = ShmWords.create(HEADER_WORDS + buckets * WAYS * ENTRY_WORDS, directory,
                              reserve=True)
        path, inc, layout = generations.handle()
        encoded = path.encode()
        if len(encoded) > _PATH_BYTES:
            shm.close()
            raise ValueError(f"generations: path {path!r} longer than {_PATH_BYTES} bytes")
        words = shm.words
        words[_BUCKETS], words[_SALT] = buckets, secrets.randbits(62)
        words[_RANK], words[_TP_RANK], words[_GEN_INC] = rank, tp_rank, inc
        words[_GEN_FIRST], words[_NUM_BLOCKS] = layout[0][2], num_blocks
        words[_PATH_WORD:HEADER_WORDS].view(np.uint8)[:len(encoded)] = np.frombuffer(
            encoded, np.uint8)
        words[0] = FORMAT
        return cls(shm, row)

    @classmethod
    def open(cls, path: str) -> HostIndex:
        """Map another worker's index (read only here; closing leaves the file).  A path
        that is not an Xavier file of :func:`~..planning.shm_words.shm_dir`, a symlink or
        another format is an error naming it."""
        _check_path(path)

        def regular(st: os.stat_result) -> None:
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"host index: {path!r} is not a regular file")

        head = ShmWords.open(path, HEADER_WORDS, check=regular)
        try:
            if int(head.words[0]) != FORMAT:
                raise ValueError(f"host index: {path!r} holds format {int(head.words[0]):#x}")
            header = head.words.copy()
        finally:
            head.close()
        buckets = int(header[_BUCKETS])
        if buckets < 1 or buckets & (buckets - 1):
            raise ValueError(f"host index: {path!r} names {buckets} buckets")
        raw = header[_PATH_WORD:HEADER_WORDS].view(np.uint8).tobytes().rstrip(b"\0")
        _check_path(raw.decode())  # the generations file it names: an Xavier file too
        gens = SlotGenerations.open((raw.decode(), int(header[_GEN_INC]), [
            (int(Tier.VLLM), 0, int(header[_GEN_FIRST]), int(header[_NUM_BLOCKS]))]))
        try:
            shm = ShmWords.open(path, HEADER_WORDS + buckets * WAYS * ENTRY_WORDS,
                                check=regular)
        except BaseException:
            gens.close()
            raise
        return cls(shm, gens.row(int(Tier.VLLM), 0), gens)

    @property
    def is_open(self) -> bool:
        """Whether the owner still has the file open (one it closed holds nothing)."""
        return int(self._shm.words[0]) == FORMAT

    # ----------------------------------------------------------------- writer
    def insert(self, rows: Sequence[Tuple[int, int, int, int]]) -> int:
        """Write ``(group, name, block, generation)`` rows (blocks of this engine whose
        forward completed); returns how many were written (the rest: dropped)."""
        if not len(rows):
            return 0
        names = name_words([r[1] for r in rows])
        groups = np.fromiter((r[0] for r in rows), np.int64, len(rows))
        blocks = np.fromiter((r[2] for r in rows), np.int64, len(rows))
        if np.any(blocks < 0) or np.any(blocks >= self.num_blocks) or np.any(groups < 0):
            raise ValueError(f"rows: a block outside 0..{self.num_blocks - 1} or a negative "
                             "group")
        entries = np.zeros((len(rows), ENTRY_WORDS), _U64)
        entries[:, :3] = names
        entries[:, _BLOCK] = (groups.astype(_U64) << _U64(32)) | blocks.astype(_U64)
        entries[:, _GENERATION] = np.fromiter((r[3] for r in rows), np.int64,
                                              len(rows)).astype(_U64)
        entries[:, _INCARNATION] = _U64(self.incarnation)
        bucket = _buckets_of(names[:, 0], groups, self._mask)
        pending = np.arange(len(rows))
        written = 0
        for _ in range(_MAX_ROUNDS):
            if not len(pending):
                break
            way = self._ways_for(entries[pending], bucket[pending])
            slot = bucket[pending] * WAYS + way
            _, first = np.unique(slot, return_index=True)  # one writer per way per round
            win = pending[np.sort(first)]
            stamp = int(self._shm.words[_STAMP])
            e = entries[win]
            e[:, _ESTAMP] = np.arange(stamp + 1, stamp + 1 + len(win)).astype(_U64)
            e[:, _CHECK] = _mix(e[:, :_CHECK], self._salt)
            w = way[np.sort(first)]
            self._table[bucket[win], w, _CHECK] = 0  # a reader in between sees no entry
            self._table[bucket[win], w] = e
            self._shm.words[_STAMP] = stamp + len(win)
            written += len(win)
            pending = np.setdiff1d(pending, win, assume_unique=True)
        self.inserted += written
        self.dropped += len(pending)
        return written

    def _ways_for(self, entries: np.ndarray, bucket: np.ndarray) -> np.ndarray:
        """The way each entry goes to: its own name's entry, else an empty one, else the
        oldest stale one (its block handed out since: kept as long as the bucket has room,
        since it still says a peer held the name once -- ``find``'s ``seen``), else the
        bucket's oldest."""
        held = self._table[bucket]  # (n, WAYS, ENTRY_WORDS)
        same = np.all(held[:, :, :_BLOCK + 1] == entries[:, None, :_BLOCK + 1], axis=2)
        blocks = (held[:, :, _BLOCK] & _LOW32).astype(np.int64)
        blocks = np.minimum(blocks, self.num_blocks - 1)
        stale = self._generations[blocks].astype(_U64) != held[:, :, _GENERATION]
        empty = held[:, :, _CHECK] == 0
        age = held[:, :, _ESTAMP].astype(np.int64)  # insertion stamps: < 2**60
        score = np.where(same & ~empty, -3 << 60,
                         np.where(empty, -2 << 60, np.where(stale, age - (1 << 60), age)))
        return np.argmin(score, axis=1)

    # ----------------------------------------------------------------- reader
    def find(self, group: int, names: np.ndarray
             ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For each name (rows of :func:`name_words`) of ``group``: ``(block, generation)``
        where it is held now (an intact entry whose generation is the block's current one;
        -1 elsewhere), and whether an intact entry names it at all (``seen``: held now, or
        held once and handed out since -- then likely saved into Xavier's tiers).  A file
        its owner closed holds nothing."""
        n = len(names)
        block_out, gen_out = np.full(n, -1, np.int64), np.full(n, -1, np.int64)
        seen_out = np.zeros(n, bool)
        if int(self._shm.words[0]) != FORMAT:  # closed by its owner (its engine went)
            return block_out, gen_out, seen_out
        bucket = _buckets_of(names[:, 0], np.full(n, group, np.int64), self._mask)
        held = self._table[bucket]  # a copy: what was there when read
        # the full checks only on the ways whose first name word matches (about one per
        # name): the same answer as checking all WAYS, a fraction of the work
        row, way = np.nonzero(held[:, :, 0] == names[:, 0:1])
        entry = held[row, way]  # (k, ENTRY_WORDS), rows in order, ways ascending per row
        seen = np.all(entry[:, 1:3] == names[row, 1:3], axis=1)
        seen &= (entry[:, _BLOCK] >> _U64(32)) == _U64(group)
        seen &= _mix(entry[:, :_CHECK], self._salt) == entry[:, _CHECK]
        seen &= entry[:, _INCARNATION] == _U64(self.incarnation)
        blocks = (entry[:, _BLOCK] & _LOW32).astype(np.int64)
        seen &= blocks < self.num_blocks
        gens = entry[:, _GENERATION].astype(np.int64)
        live = seen & (self._generations[np.where(seen, blocks, 0)] == gens)
        seen_out[row[seen]] = True
        # the first live way of each name (a stale entry of the name never hides a live one)
        live_at = np.flatnonzero(live)
        names_live, first = np.unique(row[live_at], return_index=True)
        block_out[names_live] = blocks[live_at[first]]
        gen_out[names_live] = gens[live_at[first]]
        return block_out, gen_out, seen_out

    def live_rows(self) -> List[Tuple[int, int, int, int]]:
        """``(group, name, block, generation)`` of every intact entry whose block still holds
        it (its generation is the block's current one): what this engine holds now."""
        entries = self._table.reshape(-1, ENTRY_WORDS)
        ok = entries[:, _CHECK] != 0
        ok &= _mix(entries[:, :_CHECK], self._salt) == entries[:, _CHECK]
        ok &= entries[:, _INCARNATION] == _U64(self.incarnation)
        entries = entries[ok]
        blocks = (entries[:, _BLOCK] & _LOW32).astype(np.int64)
        inside = blocks < self.num_blocks
        entries, blocks = entries[inside], blocks[inside]
        gens = entries[:, _GENERATION].astype(np.int64)
        live = self._generations[blocks] == gens
        entries, blocks, gens = entries[live], blocks[live], gens[live]
        groups = (entries[:, _BLOCK] >> _U64(32)).astype(np.int64).tolist()
        data = np.ascontiguousarray(entries[:, :3]).astype("<u8").tobytes()
        names = [int.from_bytes(data[24 * i:24 * i + 24], "little") for i in range(len(blocks))]
        return list(zip(groups, names, blocks.tolist(), gens.tolist()))

    def close(self) -> None:
        """Unmap; the owner first marks the file closed (a reader that still maps it finds
        nothing from then on), then removes it.  Idempotent."""
        if self._shm.owned:
            self._shm.words[0] = 0
        self._table = np.zeros((1, WAYS, ENTRY_WORDS), _U64)
        self._mask = 0
        self._generations = np.zeros(1, np.int64)
        self._shm.close()
        if self._own_generations is not None:
            self._own_generations.close()
            self._own_generations = None


class HostIndexLink:
    """The worker's :class:`~..planning.directory_link.DirectoryLink` with its host index:
    a registration of blocks of vLLM's own cache (``Tier.VLLM``, this engine's incarnation)
    is written into the index first, then passed on; everything else is passed on as is.
    Called by the publisher thread once the forward that computed the blocks completed.
    ``announce`` tells the directory where the index is: after the first registration
    (the directory takes announcements of registered ranks only: a rank its liveness check
    dropped and took back is registered again by that registration), then at most every
    :data:`ANNOUNCE_PERIOD_S` (a re-created directory learns it again); the worker also
    announces it once as the link is made, without waiting
    (:func:`~..vllm_side.tracker_link.writer_link`).  A failed write or announcement is
    logged and only costs peers a directory lookup."""

    def __init__(self, link: DirectoryLink, index: HostIndex,
                 announce: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._link, self._index, self._announce, self._clock = link, index, announce, clock
        self._announced_at: Optional[float] = None

    def register(self, rank: int, entries: Sequence[Entry], incarnation: int = 0) -> int:
        written = self._insert(rank, entries, incarnation)
        recorded = self._link.register(rank, entries, incarnation)
        if written is not None:
            self._announce_now(rank)
        return recorded

    def register_local(self, rank: int, entries: Sequence[Entry], incarnation: int = 0
                       ) -> int:
        """Write ``entries`` of vLLM's cache into the host index only (the whole launch is
        on this host: its peers look here; :class:`~..planning.directory_link.LocalPublishing`)."""
        written = self._insert(rank, entries, incarnation)
        if written is not None:
            self._announce_now(rank)
        return written or 0

    def forget_in_place(self, rank: int, groups: Optional[Sequence[int]] = None) -> int:
        forget = getattr(self._link, "forget_in_place", None)  # (the tracker's link)
        if forget is None:
            raise TypeError(f"{type(self._link).__name__} cannot forget a rank's vLLM cache")
        return int(forget(rank, groups))

    def republish(self, rank: int) -> int:
        """Register in the directory what the index says this engine holds now, in chunks
        of :data:`REPUBLISH_CHUNK`; returns how many were recorded."""
        rows = self._index.live_rows()
        recorded = 0
        for at in range(0, len(rows), REPUBLISH_CHUNK):
            chunk = rows[at:at + REPUBLISH_CHUNK]
            recorded += self._link.register(
                rank, [(g, k, int(Tier.VLLM), b, n) for g, k, b, n in chunk],
                self._index.incarnation)
        return recorded

    def _insert(self, rank: int, entries: Sequence[Entry], incarnation: int) -> Optional[int]:
        """Write the ``Tier.VLLM`` entries of this engine into the index (None: not written)."""
        if incarnation != self._index.incarnation:
            return None
        rows = [(g, k, s, n) for g, k, t, s, n in entries if t == Tier.VLLM]
        try:
            return self._index.insert(rows)
        except Exception as exc:
            logger.warning("rank %d: the host index (%d blocks): %r", rank, len(rows), exc)
            return None

    def _announce_now(self, rank: int) -> None:
        now = self._clock()
        if self._announced_at is None or now - self._announced_at > ANNOUNCE_PERIOD_S:
            self._announced_at = now
            try:
                self._announce()
            except Exception as exc:
                logger.warning("rank %d: announcing the host index: %r", rank, exc)

    def claim(self, rank: int, tier: int, group: int, slots: Sequence[int]) -> List[int]:
        return self._link.claim(rank, tier, group, slots)

    def move(self, rank: int, entries: Sequence[Entry], tier: int, group: int,
             slots: Sequence[int], incarnation: int = 0) -> List[int]:
        return self._link.move(rank, entries, tier, group, slots, incarnation)
