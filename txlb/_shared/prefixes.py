"""
``--policy cache-aware`` with ``--shared-state``: one cache-aware index for the fleet.

Each replica keeps its own index (:class:`~txlb._scheduling.prefix_index.FleetIndex`), so a
pick never waits for Redis; what makes it the fleet's is that every replica

* hashes prompts with **one key**, kept in Redis as ``<prefix>:prefix-key`` (made once, by
  whichever replica comes first, with ``SET NX`` from 32 random bytes: :data:`FLEET_KEY`),
  so the same prompt names the same blocks on every replica;
* **publishes** the chains it sends (backend key, block hashes) with its poll, every
  :data:`~txlb._shared.store.POLL_INTERVAL`, to the stream ``<prefix>:prefix``: one
  ``XADD ... MAXLEN ~`` per :data:`ENTRY_BLOCKS` blocks, pipelined with the poll;
* **reads** the entries since its last one with the same poll and applies the other
  replicas' to its own index, under that index's own bounds (its per-backend capacity,
  its cap on all entries).

That is what ``python -m bench.prefix --scale-out`` measures as "a copy refreshed every
100 ms": the others' sends show in this replica's lookups at most one poll (plus Redis's
latency) late.  Capacities and trust stay each replica's own, learned from the answers it
proxies.

Bounds, whatever the traffic: a replica publishes at most :data:`WRITE_ENTRIES` entries of
:data:`ENTRY_BLOCKS` blocks per poll (what it sent beyond that in one interval, the least
recent first, is not published); the stream keeps about as many blocks as the index can
list (:func:`stream_length`; older ones would be evicted on arrival anyway); a replica reads
at most :data:`READ_ENTRIES` entries per poll, and one that falls behind the trimmed stream
goes on from its oldest entry.  An entry is checked before use: another key's (its
fingerprint differs), a malformed one, or one naming a backend this replica does not have
or is removing, is ignored.

Until a replica has the fleet's key (Redis down at its start) it hashes with its own and
publishes nothing.  When the key arrives -- or changes, because Redis lost its data -- the
index starts empty (capacities and trust kept): its blocks are named by the old key and
can never match again, and they cannot be rehashed, since the index keeps hashes, not
prompts.  While Redis is down each replica keeps its own index and serves from it; on
resync it reads the key again and goes on from its last entry.

The key keeps clients from crafting prompts whose blocks collide with another tenant's: it
is never logged nor shown (``/status`` says only whether the fleet's key is in use), and
entries carry only a fingerprint of it.
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from txlb._cluster.store_capabilities import IFleetPrefixIndex
from txlb._scheduling.policies.cache_aware import CacheAware
from txlb._shared.link import RedisLink, Script
from txlb._shared.replies import ARRAY_OR_NIL, TEXT

if TYPE_CHECKING:
    from txlb._cluster.backend import Backend
    from txlb._cluster.pool import Pool

log = Logger()

#: Bytes of the fleet's hashing key (BLAKE2b takes up to 64).
KEY_BYTES = 32
#: Blocks one stream entry carries at most: ~17 KiB of hex, a few long prompts.
ENTRY_BLOCKS = 1024
#: Entries a replica writes per poll at most: 8,192 blocks per 0.1 s, 320 requests a second
#: of 256-block prompts, more than one process proxies of such prompts.
WRITE_ENTRIES = 8
#: Entries a replica reads per poll at most: every other replica's poll of a fleet of 16,
#: and at most ``READ_ENTRIES x ENTRY_BLOCKS`` blocks applied per poll.
READ_ENTRIES = 16

#: KEYS: the key's name; ARGV: a fresh random key.  Returns the fleet's key: the one stored
#: (this one if none was).
FLEET_KEY = Script("""
redis.call('SET', KEYS[1], ARGV[1], 'NX')
return redis.call('GET', KEYS[1])
""", "the cache-aware key script", TEXT)


def stream_length(max_entries: int) -> int:
    """
    Entries the stream keeps: about one index's worth of blocks (``--cache-entries``), so a
    replica that starts reads what a full index could list, and no more -- older blocks
    would be evicted on arrival by newer ones.
    """
    return max(WRITE_ENTRIES, math.ceil(max_entries / ENTRY_BLOCKS))


def fingerprint(secret: bytes) -> str:
    """Which key an entry's blocks are named with, without saying anything of the key."""
    return hashlib.blake2b(secret, digest_size=8, person=b"txlb-prefix-fp").hexdigest()


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _fields(items: object) -> dict[str, str]:
    if not isinstance(items, list):
        return {}
    texts = [_text(item) for item in items]
    return dict(zip(texts[0::2], texts[1::2], strict=False))


def decode_chain(text: str, max_blocks: int) -> list[int] | None:
    """A chain as published (16 hex digits per block), or None if it is not one."""
    if not text or len(text) % 16 or len(text) > 16 * max_blocks:
        return None
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        return None
    if 2 * len(raw) != len(text):  # fromhex skips spaces: not what a replica writes
        return None
    return list(struct.unpack(f">{len(raw) // 8}Q", raw))


def encode_chain(chain: Sequence[int]) -> str:
    """16 hex digits per block (the hashes are 64-bit): ASCII, whatever the client decodes."""
    return struct.pack(f">{len(chain)}Q", *chain).hex()


class PrefixStore(Protocol):
    """
    What the index uses of its store (:class:`~txlb._shared.store.RedisStore`, which builds
    the index: named here, so this module need not import it).
    """

    link: RedisLink
    replica: str
    #: told at each poll; their commands go pipelined with it
    on_poll: list[Callable[[], object]]

    @property
    def prefix(self) -> str: ...


@implementer(IFleetPrefixIndex)
class SharedPrefixIndex:
    """
    The fleet's key, this replica's sends published, the others' applied: see the module.

    ``policy`` returns the balancer's policy of the moment (a reload may replace it); only
    a :class:`CacheAware` one takes part.
    """

    def __init__(self, store: PrefixStore, pool: Pool, policy: Callable[[], object]) -> None:
        self.store = store
        self.pool = pool
        self.policy = policy
        self.stream = f"{store.prefix}:prefix"
        self.key_name = f"{store.prefix}:prefix-key"
        self._secret: bytes | None = None
        self._fingerprint: str | None = None
        #: the policy hashing with the fleet's key and publishing through this
        self._attached: CacheAware | None = None
        #: the id of the last entry read ("0": read the stream from its start)
        self.last_id = "0"
        #: chains sent since the last write, least recent first: (backend key, chain)
        self._unsent: OrderedDict[tuple[str, tuple[int, ...]], None] = OrderedDict()
        self._unsent_blocks = 0
        self._fetching = False
        self._reading = False
        self._key_checked = False
        self._bad_key_logged = False
        #: chains published, applied from other replicas, and ignored (another key's,
        #: malformed, or naming a backend this replica lacks)
        self.published = 0
        self.applied = 0
        self.ignored = 0
        #: chains sent that were never published (over a poll's bound)
        self.unpublished = 0
        store.on_poll.append(self.poll)
        store.link.on_up.append(self._resync)
        self.attach()

    @property
    def sharing(self) -> bool:
        """Whether this replica hashes with the fleet's key (and so publishes)."""
        return self._attached is not None and self._secret is not None

    @property
    def pending_blocks(self) -> int:
        """Blocks sent and not yet published (at most a poll's worth, while Redis is down)."""
        return self._unsent_blocks

    # -- the policy -----------------------------------------------------------------------

    def attach(self) -> None:
        """Take part through the policy of the moment (after a reload: the new one)."""
        policy = self.policy()
        if policy is self._attached:
            return
        if self._attached is not None:
            self._attached.tell_sends(None)
        self._unsent.clear()
        self._unsent_blocks = 0
        if not isinstance(policy, CacheAware):
            self._attached = None
            return
        self._attached = policy
        policy.tell_sends(self._sent)
        if self._secret is not None:
            policy.use_secret(self._secret)

    def _sent(self, backend: Backend, chain: Sequence[int]) -> None:
        """A pick (on the request's path): remember the chain for the next write, only."""
        if self._secret is None:
            return
        entry = (backend.key, tuple(chain))
        unsent = self._unsent
        if entry in unsent:
            unsent.move_to_end(entry)
            return
        unsent[entry] = None
        self._unsent_blocks += len(chain)
        bound = WRITE_ENTRIES * ENTRY_BLOCKS
        while self._unsent_blocks > bound and len(unsent) > 1:
            (_, oldest), _ = unsent.popitem(last=False)
            self._unsent_blocks -= len(oldest)
            self.unpublished += 1

    # -- the poll -------------------------------------------------------------------------

    def poll(self) -> None:
        """With the store's poll: the key if not yet read, then write and read."""
        self.attach()
        if self._attached is None or not self.store.link.connected:
            return
        if not self._key_checked:
            self._fetch_key()
            return
        self._write()
        self._read()

    def _resync(self) -> None:
        """Redis answers (again): read the key before anything else."""
        self._key_checked = False
        self._reading = False
        if self._attached is not None:
            self._fetch_key()

    def _fetch_key(self) -> None:
        if self._fetching:
            return
        self._fetching = True
        fresh = secrets.token_hex(KEY_BYTES)
        result = self.store.link.run(FLEET_KEY, [self.key_name], [fresh])
        result.addCallbacks(self._got_key, self._no_key)

    def _no_key(self, failure: Failure) -> None:
        self._fetching = False

    def _got_key(self, reply: object) -> None:
        self._fetching = False
        try:
            secret = bytes.fromhex(_text(reply))
        except ValueError:
            secret = b""
        if not 16 <= len(secret) <= 64:
            if not self._bad_key_logged:
                self._bad_key_logged = True
                log.warn("shared state: {name} in Redis is not a key this replica can use; "
                         "its cache-aware index stays its own", name=self.key_name)
            return
        self._key_checked = True
        if secret == self._secret:
            return  # the same key: go on from the last entry read
        self._secret, self._fingerprint = secret, fingerprint(secret)
        self.last_id = "0"
        self._unsent.clear()
        self._unsent_blocks = 0
        if self._attached is not None:
            self._attached.use_secret(secret)
        log.info("shared state: the cache-aware index is the fleet's (one hashing key, "
                 "every replica's sends read every poll); this replica's index starts again")

    # -- writing --------------------------------------------------------------------------

    def _write(self) -> None:
        if not self._unsent or self._fingerprint is None or self._attached is None:
            return
        unsent, self._unsent = self._unsent, OrderedDict()
        self._unsent_blocks = 0
        length = stream_length(self._attached.index.max_entries)
        batches: list[list[list[str]]] = [[]]
        blocks = 0
        for key, chain in reversed(unsent):  # the most recent first, if not all fit
            if batches[-1] and blocks + len(chain) > ENTRY_BLOCKS:
                if len(batches) == WRITE_ENTRIES:
                    self.unpublished += 1
                    continue
                batches.append([])
                blocks = 0
            batches[-1].append([key, encode_chain(chain)])
            blocks += len(chain)
        for batch in reversed(batches):  # the least recent first: read in that order
            batch.reverse()
            self._add(batch, length)

    def _add(self, batch: list[list[str]], length: int) -> None:
        if not batch:
            return
        self.published += len(batch)
        self.store.link.call(
            "XADD", self.stream, "MAXLEN", "~", length, "*",
            "r", self.store.replica, "f", self._fingerprint,
            "c", json.dumps(batch, separators=(",", ":")), expect=TEXT,
        ).addErrback(lambda failure: None)

    # -- reading --------------------------------------------------------------------------

    def _read(self) -> None:
        if self._reading:
            return
        self._reading = True
        result = self.store.link.call("XREAD", "COUNT", READ_ENTRIES,
                                      "STREAMS", self.stream, self.last_id,
                                      expect=ARRAY_OR_NIL)
        result.addCallbacks(self._entries, self._not_read)

    def _not_read(self, failure: Failure) -> None:
        self._reading = False

    def _entries(self, reply: object) -> None:
        """XREAD's answer: ``[[stream, [[id, [field, value, ...]], ...]]]`` or nothing."""
        self._reading = False
        policy = self._attached
        if policy is None or not isinstance(reply, list) or not reply:
            return
        stream = reply[0]
        if not isinstance(stream, list) or len(stream) != 2 or not isinstance(stream[1], list):
            return
        for entry in stream[1][:READ_ENTRIES]:
            if not isinstance(entry, list) or len(entry) != 2:
                continue
            self.last_id = _text(entry[0])
            try:
                self._apply(policy, _fields(entry[1]))
            except (ValueError, TypeError, struct.error):  # a shape nobody foresaw
                self.ignored += 1

    def _apply(self, policy: CacheAware, fields: dict[str, str]) -> None:
        if fields.get("r") == self.store.replica:
            return  # our own, already in our index
        try:
            batch: Any = json.loads(fields.get("c", ""))
        except ValueError:
            batch = None
        if fields.get("f") != self._fingerprint or not isinstance(batch, list):
            self.ignored += 1
            return
        max_blocks = policy.hasher.max_blocks
        for item in batch[:ENTRY_BLOCKS]:
            backend = None
            chain = None
            if (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
                    and isinstance(item[1], str)):
                backend = self.pool.get(item[0])
                chain = decode_chain(item[1], max_blocks)
            if backend is None or backend.health.removing or chain is None:
                self.ignored += 1
                continue
            policy.heard(backend, chain)
            self.applied += 1

    def status(self) -> dict[str, object]:
        """``/status``'s ``shared_state.prefix_index`` (never the key)."""
        return {
            "shared": self.sharing,
            "published": self.published,
            "applied": self.applied,
            "ignored": self.ignored,
            "unpublished": self.unpublished,
        }
