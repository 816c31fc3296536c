"""The write ledger of one dock client: its writes counted in the store's order, the journal of those a
Redis failover could still lose, and their replay once one did (docs/dock.md, "Failover").

The store counts each client's writes (lua/lib.lua). When it holds fewer than the client was told
succeeded, a failover lost the rest: they are put again from the journal, in their order, before the
next write runs.
"""
from __future__ import annotations

import logging
import threading
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from services.common.errors import FailedPrecondition, Unavailable
from services.dock.scripts import DockScripts, StaleLease, WritesLost

# Acknowledged writes a client keeps to put again if a failover loses them. A write leaves the
# journal once replicas confirm it (dock.min_replicas_acked) or when the journal is full (by count
# or by the bytes of its values); losing a write older than that is reported, not replayed.
# Replication lags by milliseconds, so these hold far more than a failover takes back.
_JOURNAL_WRITES, _JOURNAL_BYTES = 512, 64 * 2**20
logger = logging.getLogger("dockrl.dock")

# A claim's reply -> the write that applies it again (script, arguments, what it did), or None when
# it took nothing; a claim is replayed as a lease on the rows it took, not as a new claim.
Replay = Callable[[list], tuple[str, tuple, str] | None]


@dataclass(frozen=True)
class _Write:
    """A write the store acknowledged: its ledger number, the script and arguments that apply it again, and what it did."""

    seq: int
    script: str
    args: tuple
    what: str
    reply: object = None  # compared with the replay's reply where the caller used it (begin_iteration's free groups)

    @property
    def size(self) -> int:
        """Bytes of the values it carries (a put's encoded values; other writes carry next to nothing)."""
        return sum(len(arg) for arg in self.args if isinstance(arg, bytes))


class ReplicasBehind(Unavailable):
    """A write the primary applied but fewer than dock.min_replicas_acked replicas confirmed in time."""


@dataclass
class Recovery:
    """What one client found and did after a failover lost writes the store had acknowledged to it."""

    lost_writes: int  # acknowledged calls of this client the new primary did not hold
    replayed: list[str] = field(default_factory=list)  # applied again, in their order ("put rows 8-15 (prompts)")
    dropped: list[str] = field(default_factory=list)  # could not be: a lost claim's rows another claim took since (they are redone)


class WriteJournal:
    """Runs the writing scripts of one dock client under its ledger; thread-safe, one write at a time.

    One lock keeps the count in the order the store runs the writes.
    """

    def __init__(self, scripts: DockScripts, base: str, digest: str, holder: str, min_replicas_acked: int,
                 replica_ack_timeout_s: float):
        self._scripts = scripts
        self._base = base
        self._digest = digest
        self._min_replicas = min_replicas_acked
        self._replica_ack_ms = int(replica_ack_timeout_s * 1000)
        self.writer = f"{holder.replace(' ', '_') or 'dock'}/{uuid.uuid4().hex[:12]}"  # this client's id in the ledger
        self.writes = 0  # how many of its writes the store ran
        self._journal: deque[_Write] = deque()
        self._journal_bytes = 0
        self._journal_floor = 0  # writes up to this number left the journal (confirmed by replicas, or it was full)
        self._pending: deque[_Write] = deque()  # writes a failover lost, still to be put again (oldest first)
        self._lock = threading.Lock()
        self.recoveries: list[Recovery] = []  # one per failover that lost writes of this client

    def write(self, script: str, args: tuple, what: str, *, keep_reply: bool = False, replay: Replay | None = None):
        """Runs a script that changes the pool under this client's write ledger; returns its reply.

        Lost writes are put again first (_take_back, _replay_pending). `replay` turns a claim's
        reply into the write that applies it again; `keep_reply` keeps the reply to compare with
        the replay's.
        """
        with self._lock:
            while True:
                try:
                    self._replay_pending()
                    return self._write_once(script, args, what, keep_reply, replay)
                except WritesLost as lost:
                    self._take_back(lost.stored)

    def _write_once(self, script: str, args: tuple, what: str, keep_reply: bool, replay: Replay | None) -> object:
        """One writing call: counts it and journals it once the store ran it (WritesLost: the store lost earlier ones).

        With dock.min_replicas_acked it also waits for that many replicas to hold it, and raises
        ReplicasBehind (an Unavailable; the write stays in the journal) when they do not in time.
        """
        caller = f"{self._digest} {self.writer} {self.writes}"
        if self._min_replicas:
            reply, acked = self._scripts.run_acked(script, self._base, self._min_replicas, self._replica_ack_ms, caller, *args)
        else:
            reply, acked = self._scripts.run(script, self._base, caller, *args), 0
        self.writes += 1
        if self._min_replicas and acked >= self._min_replicas:
            # Replication is ordered: every earlier write is on those replicas too. Should a failover
            # still lose one (a replica that did not confirm was promoted), _take_back reports it.
            self._journal.clear()
            self._journal_bytes, self._journal_floor = 0, self.writes
        else:
            again = (script, args, what) if replay is None else replay(reply)
            if again is not None:
                entry = _Write(self.writes, *again, reply if keep_reply else None)
                self._journal.append(entry)
                self._journal_bytes += entry.size
                while len(self._journal) > _JOURNAL_WRITES or (self._journal_bytes > _JOURNAL_BYTES and len(self._journal) > 1):
                    dropped = self._journal.popleft()
                    self._journal_floor, self._journal_bytes = dropped.seq, self._journal_bytes - dropped.size
        if self._min_replicas and acked < self._min_replicas:
            raise ReplicasBehind(f"redis: {what} was applied on the primary, but only {acked} of dock.min_replicas_acked="
                                 f"{self._min_replicas} replicas confirmed it within dock.replica_ack_timeout_s="
                                 f"{self._replica_ack_ms / 1000:g}; a failover now could lose it")
        return reply

    def _take_back(self, stored: int) -> None:
        """Moves the writes the store acknowledged after its `stored`-th one, and lost, from the journal to the replay queue.

        Raises when some of them are older than the journal: they cannot be put again.
        """
        if stored < self._journal_floor:
            raise FailedPrecondition(f"a Redis failover lost writes {stored + 1}..{self.writes} of dock writer {self.writer}, "
                                     f"older than the journal this client keeps (writes after number {self._journal_floor}); "
                                     "the run's pool is no longer what its workers were told (resume the trainer from its "
                                     "checkpoint on a new dock)")
        lost = [write for write in self._journal if write.seq > stored]
        self._journal = deque(write for write in self._journal if write.seq <= stored)
        self._journal_bytes = sum(write.size for write in self._journal)
        # Writes still waiting from an earlier failover came before none of these: these go first.
        self._pending.extendleft(reversed(lost))
        self.recoveries.append(Recovery(self.writes - stored))
        self.writes = stored
        logger.warning("dock writer %s: a Redis failover lost %d acknowledged writes; putting %d of them again",
                       self.writer, self.recoveries[-1].lost_writes, len(lost))

    def _replay_pending(self) -> None:
        """Puts the writes a failover lost again, oldest first; each leaves the queue once it is applied or refused.

        A claim comes back as the same lease on the same rows (refused when another claim took a
        row since: those rows are then redone, and this client's put under that lease is refused
        as after an expired lease). A replay the replicas do not confirm in time is applied all
        the same (this call then says so). Raises when begin_iteration gives other free groups than
        it did the first time; any other error leaves the rest queued for the next call.
        """
        while self._pending:
            write = self._pending[0]
            recovery = self.recoveries[-1]
            try:
                reply = self._write_once(write.script, write.args, write.what, write.reply is not None, None)
            except StaleLease as exc:
                recovery.dropped.append(f"{write.what}: {exc}")
            except ReplicasBehind:
                recovery.replayed.append(write.what)
            else:
                if write.reply is not None and reply != write.reply:
                    raise FailedPrecondition(f"a Redis failover lost {write.what}, and putting it again gave {reply!r} "
                                             f"instead of {write.reply!r}; resume the trainer from its checkpoint on a new dock")
                recovery.replayed.append(write.what)
            self._pending.popleft()
            if not self._pending:
                logger.warning("dock writer %s after the failover: replayed %s; dropped %s", self.writer, recovery.replayed,
                               recovery.dropped)
