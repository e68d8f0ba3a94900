"""Layer: engine. Peer watchdog: when a rank dies, the others stop within ``peer_timeout`` and name it.

[Note: peer watchdog]
A rank killed mid-step (SIGKILL, the OOM killer, a lost node) leaves the others in their
next collective. Gloo notices a closed socket at once but says only "Connection reset by
peer" with a port number; NCCL, or a node that vanished without closing its sockets,
waits for the process group's timeout (30 minutes by default). Neither names the rank.

Each rank therefore runs a daemon thread that talks to the rendezvous store through its
own connection (``Store.clone()``, so a main thread blocked in the store never delays it)
under the default process group's key prefix:

- ``hb/<r>``: a counter the rank increments every ``interval`` seconds. Counters, not
  clock readings, so skewed clocks across nodes do not matter;
- ``who/<r>``: host, PID namespace and PID, so ranks on the same host can tell at once
  whether a peer's process is gone (``os.kill(pid, 0)``, zombies included);
- ``end/<r>``: written when the rank leaves on purpose: ``done`` at exit, ``error: ...``
  or ``comm: ...`` when it stops on an exception (its own fault, or a failed collective).
  A rank that has ended is never called dead;
- ``dead``: the first finding, so every rank reports the same culprit.

The thread watches the next two ranks (ring order: O(world) store traffic in all). A peer
whose process is gone, or whose counter has not moved for ``peer_timeout`` seconds without
an ``end`` marker, is dead: the thread writes ``dead``, prints which rank, and, unless the
main thread is already handling an exception, ends the process with exit status 1 after
a short grace (the main thread may be blocked in a collective that would otherwise wait
for the process-group timeout).

When the main thread gets an exception (Lightning's ``Strategy.on_exception``, or the
uncaught-exception hook for Fabric and Accelerate scripts), ``explain`` looks at every
rank: a rank that stopped with its own error first, a rank that is gone or silent; it
waits at most ``peer_timeout`` for the evidence, prints the culprit and lets the
exception go on (the process exits non-zero as before, now with the rank named).

The store itself lives in rank 0's process unless torchrun hosts it (its agent does, by
default). When the store stops answering, the thread ends quietly: that also happens when
rank 0 finishes first on a normal run, and a watchdog must never fail a job that worked.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

log = logging.getLogger(__name__)

EXIT_STATUS = 1
WATCHED_PEERS = 2  # each rank watches the next two in ring order
_COMM_WORDS = ("gloo", "nccl", "connection reset", "connection closed", "connection refused", "broken pipe",
               "timed out", "timeout", "socket")

_generation = 0  # watchdogs started in this process: keys of a later engine never see an earlier one's
_current: PeerWatchdog | None = None
_hook_installed = False


def _interval(timeout: float) -> float:
    return min(5.0, max(0.2, timeout / 10))


def _identity() -> str:
    try:
        pidns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        pidns = "?"
    return f"{socket.gethostname()}|{pidns}|{os.getpid()}"


def _process_gone(identity: str) -> bool:
    """True when ``identity`` names a process on this host (same PID namespace) that no
    longer runs (absent, or a zombie waiting to be reaped)."""
    host, pidns, pid = identity.split("|")
    mine_host, mine_ns, _ = _identity().split("|")
    if host != mine_host or pidns != mine_ns or pidns == "?":
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError):
        return False
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state in ("Z", "X")
    except (OSError, IndexError):
        return False


def is_comm_failure(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a collective that failed because of another rank."""
    names = {c.__name__ for c in type(exc).__mro__}
    if names & {"DistBackendError", "DistNetworkError", "DistStoreError"}:
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(w in text for w in _COMM_WORDS)


class PeerWatchdog:
    """Heartbeats through the rendezvous store; see [Note: peer watchdog]."""

    def __init__(self, store: Any, *, rank: int, world_size: int, timeout: float, generation: int,
                 exit: Callable[[int], None] = os._exit) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout = float(timeout)
        self.interval = _interval(self.timeout)
        self._prefix = f"zeropp/peers/{generation}/"
        self._exit = exit
        self._pid = os.getpid()
        self._lock = threading.Lock()  # one store request at a time from this object
        self._stop = threading.Event()
        self._handling = threading.Event()  # the main thread is explaining an exception
        self._explained: set[int] = set()
        self.finding: str | None = None
        self._peers = [(rank + k) % world_size for k in range(1, min(WATCHED_PEERS, world_size - 1) + 1)]
        self._last: dict[int, tuple[int, float]] = {}  # peer -> (counter, when it last changed)
        self._who: dict[int, str] = {}
        self._ended = False
        self._request(lambda s: s.set(self._key("who", rank), _identity()))
        self._beat()
        self._thread = threading.Thread(target=self._run, name=f"zeropp-watchdog-{rank}", daemon=True)
        self._thread.start()

    # -- start / stop -----------------------------------------------------------------------

    @classmethod
    def start(cls, *, timeout: float, rank: int, world_size: int) -> PeerWatchdog | None:
        """This process's watchdog (replacing an earlier one), or None when there is nothing
        to watch: one rank, ``timeout == 0``, or a store that cannot be cloned. No
        collective: every rank starts its engine in the same order, so the generation
        counter agrees without one."""
        global _generation, _current
        _generation += 1
        if _current is not None:
            _current.stop()
            _current = None
        if world_size <= 1 or timeout <= 0 or not dist.is_initialized():
            return None
        try:
            store = dist.distributed_c10d._get_default_store().clone()
        except Exception as e:  # noqa: BLE001 - a store without clone (e.g. HashStore): no watchdog
            log.info("zeropp: no peer watchdog (%s cannot be cloned: %s)", type(e).__name__, e)
            return None
        store.set_timeout(timedelta(seconds=max(2.0, 2 * _interval(timeout))))
        _current = cls(store, rank=rank, world_size=world_size, timeout=timeout, generation=_generation)
        _install_hooks()
        return _current

    def stop(self, reason: str = "done") -> None:
        """Mark this rank as ended on purpose (peers will not call it dead) and stop the thread."""
        if os.getpid() != self._pid:
            return
        self._mark_end(reason)
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval + 1)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    # -- store access ------------------------------------------------------------------------

    def _key(self, kind: str, rank: int | None = None) -> str:
        return self._prefix + (kind if rank is None else f"{kind}/{rank}")

    def _request(self, fn: Callable[[Any], Any]) -> Any:
        with self._lock:
            return fn(self.store)

    def _beat(self) -> None:
        self._request(lambda s: s.add(self._key("hb", self.rank), 1))

    def _read(self, kind: str, rank: int | None = None) -> str | None:
        key = self._key(kind, rank)

        def get(s: Any) -> str | None:
            return s.get(key).decode(errors="replace") if s.check([key]) else None

        return self._request(get)

    def _mark_end(self, reason: str) -> None:
        if self._ended:
            return
        self._ended = True
        try:
            self._request(lambda s: s.set(self._key("end", self.rank), reason[:500]))
        except Exception:  # noqa: BLE001 - the store may be gone already (rank 0 exited)
            pass

    # -- the heartbeat thread ----------------------------------------------------------------

    def _run(self) -> None:
        failing_since: float | None = None
        while not self._stop.wait(self.interval):
            try:
                self._beat()
                finding = self._read("dead") or self._check(self._peers, stale_after=self.timeout)
                failing_since = None
            except Exception:  # noqa: BLE001 - store unreachable: retry, then end quietly
                now = time.monotonic()
                failing_since = failing_since or now
                if now - failing_since > self.timeout:
                    return
                continue
            if finding:
                self._found(finding)
                return

    def _check(self, peers: list[int], *, stale_after: float) -> str | None:
        """A message naming the first of ``peers`` that is dead, or None."""
        now = time.monotonic()
        for peer in peers:
            if self._read("end", peer) is not None:
                continue
            counter = int(self._request(lambda s, p=peer: s.add(self._key("hb", p), 0)))
            last = self._last.get(peer)
            if last is None or last[0] != counter:
                self._last[peer] = (counter, now)
                silent = 0.0
            else:
                silent = now - last[1]
            who = self._who.get(peer) or self._read("who", peer)
            if who:
                self._who[peer] = who
                if _process_gone(who):
                    return f"rank {peer} ({_describe(who)}) is gone: its process no longer runs"
            if silent > stale_after:
                where = f" ({_describe(who)})" if who else ""
                return (f"rank {peer}{where} stopped responding: no heartbeat for {silent:.0f} s "
                        f"(peer_timeout={self.timeout:g} s)")
        return None

    def _publish(self, finding: str) -> str:
        key = self._key("dead")
        try:
            stored = self._request(lambda s: s.compare_set(key, "", finding.encode()))
            return stored.decode(errors="replace") if isinstance(stored, bytes) else finding
        except Exception:  # noqa: BLE001
            return finding

    def _found(self, finding: str) -> None:
        self.finding = finding = self._publish(finding)
        if self._handling.is_set():
            return  # the main thread reports it (explain)
        _say(f"zeropp: {finding}. Stopping rank {self.rank} too. Fix: read that rank's log (an OOM kill "
             "shows in `dmesg` / the scheduler's log); resume from the newest checkpoint.")
        # Grace for a main thread that is about to fail on its own and explain.
        deadline = time.monotonic() + min(5.0, self.timeout)
        while time.monotonic() < deadline and not self._handling.is_set():
            time.sleep(0.1)
        if not self._handling.is_set():
            self._mark_end(f"comm: {finding}")
            self._exit(EXIT_STATUS)

    # -- the main thread's exception path ----------------------------------------------------

    def explain(self, exc: BaseException) -> str | None:
        """Why ``exc`` happened when another rank is to blame: prints and returns a line
        naming that rank (waits at most ``peer_timeout`` for the evidence), or None."""
        if os.getpid() != self._pid or id(exc) in self._explained:
            return None
        self._explained.add(id(exc))
        self._handling.set()
        comm = is_comm_failure(exc)
        self._mark_end(("comm: " if comm else "error: ") + f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        if not comm:
            return None  # this rank's own error: its traceback says it all
        others = [r for r in range(self.world_size) if r != self.rank]
        deadline = time.monotonic() + self.timeout + 2 * self.interval
        finding = self.finding
        while finding is None and time.monotonic() < deadline:
            try:
                finding = self._read("dead") or self._first_error(others) or self._check(
                    others, stale_after=min(self.timeout, 3 * self.interval))
            except Exception:  # noqa: BLE001 - the store is gone with its host
                gone = [r for r, who in sorted(self._who.items()) if _process_gone(who)]
                finding = (f"rank {gone[0]} ({_describe(self._who[gone[0]])}) is gone: its process no longer runs"
                           if gone else "the rendezvous store stopped answering; it runs in rank 0's process "
                           "unless torchrun hosts it, so rank 0 has most likely died")
            if finding is None:
                time.sleep(self.interval / 2)
        if finding is None:
            return None
        if finding and not finding.startswith("the rendezvous"):
            finding = self._publish(finding)
        line = f"zeropp: rank {self.rank}'s collective failed because {finding}. Fix: read that rank's log."
        _say(line)
        return line

    def _first_error(self, ranks: list[int]) -> str | None:
        for r in ranks:
            end = self._read("end", r)
            if end is not None and end.startswith("error: "):
                return f"rank {r} stopped with an error ({end[len('error: '):]})"
        return None


def _describe(identity: str) -> str:
    host, _, pid = identity.split("|")
    return f"pid {pid} on {host}"


def _say(line: str) -> None:
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - a closed stderr must not mask the exit
        pass


def current() -> PeerWatchdog | None:
    """This process's running watchdog, if any."""
    return _current if _current is not None and os.getpid() == _current._pid else None


def _install_hooks() -> None:
    """Once per process: an exception that reaches the top explains itself first (Fabric
    and Accelerate scripts; Lightning calls ``explain`` from ``on_exception``), and a
    normal exit marks the rank as ended so that no peer calls it dead."""
    global _hook_installed
    if _hook_installed:
        return
    _hook_installed = True
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        previous(exc_type, exc, tb)
        watchdog = current()
        if watchdog is not None and not isinstance(exc, KeyboardInterrupt):
            watchdog.explain(exc)

    sys.excepthook = hook

    def at_exit() -> None:
        watchdog = current()
        if watchdog is not None:
            watchdog.stop()

    atexit.register(at_exit)
