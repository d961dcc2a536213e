"""The rank-process protocol: every message a rank process and the coordinator exchange, declared once.

A rank process (:mod:`.child`) talks to its proxy (:mod:`.proxy`) over one socket per thread, a *channel*: the
main thread's, and one for each thread the program starts (:mod:`.rank_threads`).  On a channel the rank process
sends *requests* (:data:`REQUESTS`), each answered with :data:`OK` or :data:`ERR` while the thread waits, and
*notes* (:data:`NOTES`), never answered; the last message on a channel is one of :data:`FINAL`.  Before the
proxy serves the rank, the proxy sends :class:`Setup` and the rank process answers :data:`READY`.

A message is a plain tuple ``(kind, *fields)``, pickled onto its channel (:func:`._wire.send`): a tuple rather
than a class instance because every forwarded call costs two messages and a tuple pickles several times
faster.  Each side dispatches on ``kind`` through a table of handlers built once (:func:`handler_table`), as
pytest-xdist's ``worker_<event>``: the proxy has a method ``handle_<kind>`` for each message it serves
(:mod:`.proxy_handlers`), the rank process a function ``on_<kind>`` for each answer (:mod:`.client`).  A kind
without a handler fails at import; a message of no known kind fails loudly where it arrives.
"""
from __future__ import annotations

import struct
from typing import Any, Callable, Iterable, NamedTuple

__all__ = [
    "CALL", "GROUP", "RENDEZVOUS", "WAIT", "COMPLETED", "SUCCESS", "SOURCE", "STEP", "SHARE", "UNSHARE", "THREAD", "JOIN", "LEAVE", "REJOIN",
    "SLEEP", "WAKE", "FREE", "RPC_START", "RPC_CALL", "RPC_WAIT", "RPC_ANSWER", "RPC_REF", "RPC_READY",
    "RPC_SHUTDOWN", "STILL_PENDING", "MODULES", "END", "RESULT", "EXIT", "FORWARDED", "RAISE", "READY", "OK", "ERR",
    "REQUESTS", "NOTES", "FINAL", "SERVED", "ANSWERS", "Setup", "FDS_REQUEST", "FDS_WHERE", "FDS_PASSED",
    "WARM_RECORD", "WARM_READY", "WARM_FORKED", "WARM_EXITED", "WARM_TAINTED", "WARM_LOADED", "handler_table",
]

# ---------------------------------------------------------------------------------------------------------------
# rank process -> proxy: requests (the thread waits for OK or ERR)
# ---------------------------------------------------------------------------------------------------------------
#: ``(CALL, name, args, site, backward, cpu)``: backend collective ``name`` with its tensors staged (see
#: :mod:`.staging`), issued at ``site`` during ``backward`` (or None), ``cpu`` s of compute since the last
#: request; answers None, the source rank (a blocking recv) or the id of an ``async_op`` call's work
CALL = "call"
#: ``(GROUP, method, ranks, site, cpu, name)``: ``new_group_handle`` or ``member_group_handle`` over ``ranks`` (``name``:
#: torch's name of the group, or None);
#: answers the group's id (None: not a member)
GROUP = "group"
#: ``(RENDEZVOUS, key, rank, size, cpu)``: claim ``rank`` of the ``size``-rank process group over part of the
#: world that meets at ``key`` (``init_process_group(rank=r, world_size=k)``, see
#: :mod:`simulator.adapters.torch_groups`); answers its members' simulated ranks, in its ranks' order
RENDEZVOUS = "rendezvous"
#: ``(WAIT, wid, cpu, timeout, asked_at)``: wait for work ``wid`` (``timeout`` counted from ``asked_at``,
#: ``time.time()`` in the rank process); answers True
WAIT = "wait"
#: ``(COMPLETED, wid)``: ``Work.is_completed()`` of work ``wid``
COMPLETED = "completed"
#: ``(SUCCESS, wid)``: ``Work.is_success()`` of work ``wid``
SUCCESS = "success"
#: ``(SOURCE, wid)``: ``Work.source_rank()`` of work ``wid``
SOURCE = "source"
#: ``(STEP, optimizer_id, cpu)``: an optimizer step ended (a training step on the rank's clock)
STEP = "step"
#: ``(SHARE, sid, nbytes)`` + one descriptor: a storage of the program in shared memory, known as ``sid`` from
#: now on (calls on it are not staged)
SHARE = "share"
#: ``(UNSHARE, sids)``: the program no longer has the shared storages ``sids`` in shared memory (dropped, or given
#: ordinary memory to resize): the proxy lets go of their mappings
UNSHARE = "unshare"
#: ``(THREAD, name, daemon)`` + one descriptor (the thread's channel): the thread starts a thread, which gets an
#: actor of the rank; answers the thread's id
THREAD = "thread"
#: ``(JOIN, tid)``: ``Thread.join()`` without a timeout, a wait the scheduler sees
JOIN = "join"
#: ``(LEAVE, others)``: the main thread steps out of the schedule around a wait the scheduler cannot see (an Event,
#: a Queue, a Future), if its own threads may end it, or, ``others``, any actor (the process serves RPC); answers
#: whether it left
LEAVE = "leave"
#: ``(REJOIN,)``: back from the wait of a LEAVE
REJOIN = "rejoin"
#: ``(SLEEP, seconds, where[, what])``: a polling ``time.sleep`` of the main thread (coop mode), or another wait in
#: the OS (``what``: a store's get of a key not set yet), steps out of the schedule;
#: answers whether it left
SLEEP = "sleep"
#: ``(WAKE,)``: back from the sleep of a SLEEP
WAKE = "wake"
#: ``(FREE,)``: the rank started torch's own RPC agent: its compute runs outside the coop schedule from now on
FREE = "free"

# tensorplay's RPC between rank processes, performed by the simulator's RPC world in the coordinator (see
# :mod:`.rpc_routes` and :mod:`.rpc_process`); every one carries ``books``, the RRef references and
# distributed-autograd contexts the process released since its last RPC request, and ``cpu`` last
#: ``(RPC_START, name, rank, world_size, options, secret, books, cpu)`` + one descriptor (the worker's event
#: socket: the coordinator sends the process's dispatcher ``("serve", request id, message, context id, RRef id to
#: keep the value in or None, device map of the answer, the workers)`` + the handler thread's channel,
#: ``("answer", call id, ok, message or error)``, ``("drop", RRef id)``, ``("context", context id)`` and
#: ``("closed",)``):
#: ``init_rpc``; answers the workers' ``[(name, rank), ...]`` once every worker has started
RPC_START = "rpc_start"
#: ``(RPC_CALL, call, dst, message, timeout, mode, retains, site, cid, books, cpu)``: send ``message`` (the
#: request ``(fn, args, kwargs)`` this process serialised) to worker ``dst``; ``mode`` "sync" answers the
#: answer's message (or fails with the call's error), "async" the call's id at once, "remote" the RRef's id,
#: "fetch" (``RRef.to_here``: a copy of the owner's value, no event on the trace) the answer's message
RPC_CALL = "rpc_call"
#: ``(RPC_WAIT, call_id, timeout, books, cpu)``: wait for async call ``call_id`` (``timeout``: the waiter's own
#: bound, seconds or None); answers ``(True, message)``, ``(False, error)``, :data:`STILL_PENDING` when the bound
#: passed first, or None when the answer went to the process's dispatcher already
RPC_WAIT = "rpc_wait"
STILL_PENDING = "still pending"
#: ``(RPC_ANSWER, request_id, message, was_async, retains, books, cpu)``: a handler thread's answer to a request
#: (on the thread's channel, which the request's handler actor serves); ``retains``: the RRefs it carries
RPC_ANSWER = "rpc_answer"
#: ``(RPC_REF, books, cpu)``: a new RRef owned by this worker (``RRef(value)``); answers its id
RPC_REF = "rpc_ref"
#: ``(RPC_READY, owner, rref_id, timeout, books, cpu)``: wait (at most ``timeout`` seconds, None: the run's bounds)
#: until the owner kept RRef ``rref_id``'s value; answers
#: None (or fails with the error that lost it)
RPC_READY = "rpc_ready"
#: ``(RPC_SHUTDOWN, graceful, books, cpu)``: ``rpc.shutdown``; answers the workers a graceful shutdown did not
#: wait for
RPC_SHUTDOWN = "rpc_shutdown"

# ---------------------------------------------------------------------------------------------------------------
# rank process -> proxy: notes (never answered) and the last message of a channel
# ---------------------------------------------------------------------------------------------------------------
#: ``(MODULES, names)``: the libraries the rank imported (its warm interpreter imports them ahead next time)
MODULES = "modules"
#: ``(END,)``: a thread the program started has ended (the last message on its channel)
END = "end"
#: ``(RESULT, pickled, cpu)``: the rank's function returned; ``cpu`` s of compute since its last request
RESULT = "result"
#: ``(EXIT, code, traceback)``: the rank called ``sys.exit(code)`` (``traceback``: where, or None)
EXIT = "exit"
#: ``(FORWARDED, eid, traceback text)``: the rank failed with the coordinator's own error ``eid`` (see ERR), raised
#: where the program called
FORWARDED = "forwarded"
#: ``(RAISE, pickled or None, class name, text, traceback)``: the rank's function raised
RAISE = "raise"
#: ``(READY,)``: start-up done (sent once, before the proxy serves the rank)
READY = "ready"

# ---------------------------------------------------------------------------------------------------------------
# proxy -> rank process: answers (the last field lists ``(wid, ok)`` of the async works completed since the last)
# ---------------------------------------------------------------------------------------------------------------
#: ``(OK, value, done)``: the request succeeded with ``value``
OK = "ok"
#: ``(ERR, eid, module, qualname, text, attrs, done)``: the request failed with the coordinator's error ``eid``
ERR = "err"

#: what a thread of the rank process sends and waits for the answer to
REQUESTS = frozenset({CALL, GROUP, RENDEZVOUS, WAIT, COMPLETED, SUCCESS, SOURCE, STEP, SHARE, UNSHARE, THREAD, JOIN, LEAVE,
                      REJOIN, SLEEP, WAKE, FREE, RPC_START, RPC_CALL, RPC_WAIT, RPC_ANSWER, RPC_REF, RPC_READY,
                      RPC_SHUTDOWN})
#: what the rank process sends without waiting (its channel goes on)
NOTES = frozenset({MODULES})
#: the last message on a channel: the thread, or the rank, has ended
FINAL = frozenset({END, RESULT, EXIT, FORWARDED, RAISE})
#: every message the proxy serves (READY comes before it does)
SERVED = REQUESTS | NOTES | FINAL
#: what the proxy answers a request with
ANSWERS = frozenset({OK, ERR})


class Setup(NamedTuple):
    """The first message on a rank process's main channel (the proxy's): who the rank is and what it runs."""

    rank: int
    world_size: int
    seed: int  #: the run's seed (the rank's ``random`` module is seeded from it)
    prep: dict  #: multiprocessing.spawn's preparation data: the coordinator's sys.path, cwd and main module
    payload: bytes  #: pickled ``(fn, args, kwargs)``
    passed: int  #: descriptors sent after the where socket (what the arguments inherit; see pickling)
    torch_rng: Any  #: the rank's starting torch RNG state
    arena_dir: str  #: where its arenas are created
    timeout: float  #: the groups' timeout, in seconds
    store: tuple  #: ``(host, port)`` of the run's TCPStore (torch.distributed's rendezvous of rank processes)
    learn: bool  #: report the libraries it imported (MODULES): it was forked from a warm interpreter
    mode: str  #: the scheduler's mode ("coop" or "threads")
    rpc_secret: Any  #: the run's RPC secret (str or None)
    #: what the whole rank runs inside (a picklable factory of a context manager, handed in by the world: the
    #: CUDA stand-in's devices with devices="cuda"), or None
    device_context: Any = None
    #: torch's RPC API keeps torch's own agent (real TensorPipe between the rank processes), rather than the
    #: simulator's transport (torch's RPC test fixtures, which test that agent; see simulator.torch_harness)
    own_torch_rpc: bool = False


#: the one-byte payloads that carry descriptors (``socket.send_fds``), right after what they belong to
FDS_REQUEST = b"f"  # after SHARE (the storage) or THREAD (the new thread's channel)
FDS_WHERE = b"w"  # after Setup: the socket on which the proxy asks where the program is (a number; answered
#                   ``(number, [(file, line, function), ...])``, the main thread's stack)
FDS_PASSED = b"p"  # after that, when Setup.passed: the descriptors the arguments inherit

# ---------------------------------------------------------------------------------------------------------------
# the warm interpreter's control socket (see .warm): fixed-size records ``(kind, pid, status)``
# ---------------------------------------------------------------------------------------------------------------
WARM_RECORD = struct.Struct("<cqq")
WARM_READY = b"R"  # started and imported what every rank process needs
WARM_FORKED = b"P"  # forked rank process ``pid``
WARM_EXITED = b"X"  # rank process ``pid`` ended with ``status`` (as Popen's returncode)
WARM_TAINTED = b"T"  # refused to fork (import ``pid`` of its last batch started a thread) and ended
WARM_LOADED = b"L"  # imported ahead what a request without an environment named


def handler_table(owner: Any, prefix: str, kinds: Iterable[str]) -> dict[str, Callable[..., Any]]:
    """``{kind: owner.<prefix><kind>}`` for each of ``kinds``: built once, so a dispatch is one dict lookup.

    A kind without a handler, or a handler named after no kind, raises ``TypeError`` (at import: the protocol
    and its handlers cannot drift apart).
    """
    kinds = frozenset(kinds)
    table = {kind: getattr(owner, prefix + kind, None) for kind in kinds}
    missing = sorted(kind for kind, handler in table.items() if not callable(handler))
    stray = sorted(name for name in dir(owner) if name.startswith(prefix) and name[len(prefix):] not in kinds)
    if missing or stray:
        raise TypeError(f"{getattr(owner, '__qualname__', owner)}: no {prefix}<kind> handler for {missing}; "
                        f"handlers of no message kind: {stray}")
    return table
