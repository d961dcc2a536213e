"""Human-readable reports: the mismatch table and the "who waits for what" description.

Messages follow tensorplay's pattern: what went wrong, the values of every
rank, then the fix.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Sequence

from simulator.core.callsite import split_site
from simulator.core.progress import is_waiting
from simulator.core._actor import BLOCKED, DONE, FREE, RUNNABLE
from simulator.core.state import P2PRecord, Slot

if TYPE_CHECKING:  # pragma: no cover
    from simulator.core.state import RankState, Run

__all__ = ["mismatch_message", "is_new_group", "describe_world", "fmt_ranks", "stall_headline", "timeout_headline"]

_MAX_ROWS = 64
_BACKWARD_FIX = ("call .backward() on every rank, e.g. y.sum().backward() — non-root outputs are zeros "
                 "so this is always correct; if that rank did, the collective's input did not require grad there: "
                 "make requires_grad the same on every rank (the backward of a collective is a collective too)")


def fmt_ranks(ranks: Iterable[int], limit: int = 16) -> str:
    rs = list(ranks)
    if len(rs) <= limit:
        return "[" + ", ".join(map(str, rs)) + "]"
    return "[" + ", ".join(map(str, rs[:limit])) + f", ... ({len(rs)} ranks)]"


def group_label(g: Any) -> str:
    """``[0, 2]``; a subgroup that spans the whole world is told apart from the world by its id."""
    text = fmt_ranks(g.ranks)
    if g.gid != 0 and g.ranks == tuple(range(len(g.ranks))):
        text += f" (subgroup {g.gid})"
    return text


def _and(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return str(ranks[0])
    if len(ranks) > 16:
        return fmt_ranks(ranks)
    return ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def _dtype(d: Any) -> str:
    return "-" if d is None else str(d).replace("torch.", "")


def _row_values(call: Any, group_ranks: tuple[int, ...]) -> list[str]:
    name, op, root, dtype, shape = call.key
    return [
        str(call.rs.rank), name, "-" if op is None else op.name,
        "-" if root is None else str(group_ranks[root]), _dtype(dtype),
        call.detail if call.detail is not None else ("-" if shape is None else str(tuple(shape))),
        call.site,
    ]


def is_new_group(calls: Sequence[Any]) -> bool:
    """The calls are ``new_group``'s, whose key carries the member list where a collective's carries a shape."""
    return all(c.key[0] == "new_group" for c in calls)


# what torch's composite calls (simulator.core.callsite.COMPOSITES) send, for a mismatch inside one
_COMPOSITE_NOTES = {
    "broadcast_object_list": "its first broadcast carries one int64 size per object, so its shape (n,) is "
                             "len(object_list): every rank must pass a list of the same length",
    "send_object_list": "its first message carries one int64 size per object: the receiver's len(object_list) "
                        "must equal the sender's",
    "scatter_object_list": "it broadcasts the largest pickled size, then scatters one padded byte tensor per rank",
    "gather_object": "it exchanges each rank's pickled size, then the padded pickled bytes",
}
_COMPOSITE_NOTES["recv_object_list"] = _COMPOSITE_NOTES["send_object_list"]
_COMPOSITE_NOTES["all_gather_object"] = _COMPOSITE_NOTES["gather_object"]


def _composite_note(kind: str, calls: Sequence[Any]) -> str | None:
    """A line naming the torch calls the mismatched operation was issued in, if every rank was in one (a pair of
    send_object_list and recv_object_list counts as one)."""
    apis = sorted({split_site(c.site)[1] for c in calls})
    notes = {_COMPOSITE_NOTES.get(a) for a in apis}
    if len(notes) != 1 or None in notes:
        return None
    return f"  this {kind} is torch's own, issued inside {' and '.join(apis)}: {notes.pop()}"


def mismatch_message(kind: str, group: Any, seq: int | None, calls: list[Any], reason: str) -> str:
    """The table of what each rank called, for a :class:`CollectiveMismatchError`."""
    group_ranks = group.ranks
    where = f"call #{seq} on group {group_label(group)}" if seq is not None else f"a {kind} on group {group_label(group)}"
    head = f"tensorplay.distributed ranks disagree in {where}: {reason}"
    note = _composite_note(kind, calls)
    if note is not None:
        head += "\n" + note
    cols = ["rank", "collective", "op", "root", "dtype", "shape", "called at"]
    rows = [_row_values(c, group_ranks) for c in calls[:_MAX_ROWS]]
    widths = [max(len(cols[i]), *(len(r[i]) for r in rows)) for i in range(len(cols))]
    lines = [head, "  " + " | ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines.append("  " + "-+-".join("-" * w for w in widths))
    for r in rows:
        lines.append("  " + " | ".join(v.ljust(w) for v, w in zip(r, widths)))
    if len(calls) > _MAX_ROWS:
        lines.append(f"  ... ({len(calls) - _MAX_ROWS} more ranks)")
    if is_new_group(calls):
        lines.append("Fix: new_group is collective over the whole world: every rank calls it, in the same order, "
                     "with the same ranks (a rank outside the group passes them too and gets no group back)")
    else:
        lines.append("Fix: every member of a group must issue the same collectives in the same order, with the "
                     "same op, root, dtype and shape (matching split sizes for all_to_all); guard rank-specific "
                     "code so it does not skip or reorder collectives")
    return "\n".join(lines)


def describe_wait(run: "Run", rs: Any) -> str:
    """What ``rs`` waits for, without the leading "rank r"."""
    w = rs.waiting
    if isinstance(w, Slot):
        arrived = [c.rs.rank for c in w.calls if c is not None]
        missing = sorted(set(w.group.ranks) - set(arrived))
        mine = w.calls[w.group.index[rs.rank]]
        site = mine.site if mine is not None else "?"
        how = " (in wait() of an async op)" if mine is not None and mine.async_op else ""
        return (f"in {w.name} #{w.seq} on group {group_label(w.group)} at {site}{how} "
                f"(arrived: {fmt_ranks(arrived)}; missing: {fmt_ranks(missing)})")
    if isinstance(w, P2PRecord):
        tail = f"tag {w.tag}, group {fmt_ranks(w.group.ranks)}, at {w.site}"
        if w.kind == "send":
            return f"in send to rank {w.dst} ({tail}): no matching recv was posted"
        src = "any rank" if w.src is None else f"rank {w.src}"
        return f"in recv from {src} ({tail}): no matching send was posted"
    if callable(getattr(w, "describe", None)):  # waits of other layers (e.g. RPC barriers) describe themselves
        return w.describe()
    return "in an unknown wait"


def _held_turn(held: Any, thread: Any) -> str:
    """Why a coop rank holding the turn while a thread of its own waits for it may never go on, and the fix."""
    return (f"{thread.label} waits for it (coop mode: one actor runs at a time). If {held.label} waits for that "
            f"thread outside the simulator (a lock the thread holds across an operation, a pipe or a FIFO it writes "
            f"after one), neither can go on. Fix: run with mode='threads' (--mode threads), or wait through a "
            f"threading.Event, Queue or Condition, which step out of the schedule")


def held_turn_warning(held: Any, thread: Any, seconds: float) -> str:
    """The warning when a coop rank holds the turn, blocked, while a thread of its own waits for it (see
    :func:`simulator.core.progress.watch_turn`)."""
    return (f"[simulator] {held.label} has held the turn for {seconds:.0f} s, blocked outside the simulator at "
            f"{_where(held)}, while {_held_turn(held, thread)}.")


def _where(rs: Any, depth: int = 3) -> str:
    """The innermost frames of the program that ``rs``'s thread is executing now (for a timeout report)."""
    import sys
    import traceback

    if rs.where is not None:  # the rank's program runs in its own process: that process says where
        return format_frames(rs.where(), depth)
    t = rs.thread
    frame = sys._current_frames().get(t.ident) if t is not None and t.ident is not None else None
    if frame is None:
        return "?"
    return format_frames([(f.filename, f.lineno, f.name) for f in traceback.extract_stack(frame)], depth)


def format_frames(frames: list[tuple[str, int, str]], depth: int = 3) -> str:
    """``file.py:12 in fn <- ...``: the ``depth`` innermost frames of the program (the simulator's are left out)."""
    mine = [f for f in frames if "/simulator/" not in f[0] and "/threading.py" not in f[0]
            and "runpy" not in f[0] and not f[0].endswith("multiprocessing/process.py")]  # how the command line
    # runs a script (runpy) or a launched rank (Process.run): not the program's own code
    if not mine:
        return "?"
    return " <- ".join(f"{name.rsplit('/', 1)[-1]}:{line} in {fn}" for name, line, fn in reversed(mine[-depth:]))


def describe_world(run: "Run", headline: str = "", timeout: bool = False, *, bound: str | None = None,
                   waiting: Sequence[Any] = ()) -> str:
    """One line per distinct situation: who waits where, who returned, who is still running.

    With ``timeout=True`` a rank that is running (not waiting in any operation) is shown with where it is
    computing, since a stuck computation, not a collective-order bug, is what a timeout usually means.
    ``bound`` (``"stall"`` or ``"timeout"``, implies ``timeout=True``) is the bound of the run that ran out: the
    headline says which (``waiting``: the actors that waited, for a stall) and the fix names its knob.
    """
    if bound is not None:
        timeout = True
        headline = stall_headline(run, waiting, run.clock()) if bound == "stall" else timeout_headline(run)
    groups: dict[str, list[int]] = {}
    order: list[str] = []
    recv_waiters: list[int] = []
    computing: list[int] = []
    hints: list[str] = []
    for rs in run.ranks:
        if rs.state == BLOCKED:
            text = "waits " + describe_wait(run, rs)
            if isinstance(rs.waiting, P2PRecord) and rs.waiting.kind == "recv":
                recv_waiters.append(rs.rank)
        elif rs.state == DONE:
            text = "has returned" if rs.exc is None else f"has failed ({type(rs.exc).__name__})"
        else:
            last = f"last call at {rs.last_site}" if rs.ops else "before its first operation"
            # FREE: a coop rank outside the schedule (in time.sleep, or a wait the scheduler cannot see) runs too
            if rs.state == FREE or getattr(run.sched, "current", rs) is rs or not run.sched.baton:
                if timeout:
                    computing.append(rs.rank)
                    text = f"is computing, in no operation, at {_where(rs)} ({last})"
                else:
                    text = f"is running ({last})"
            else:
                text = f"is ready, waiting for the baton while another rank computes ({last})"
        if text not in groups:
            groups[text] = []
            order.append(text)
        groups[text].append(rs.rank)
    threads = []  # threads the ranks started: one line each, after the ranks
    for rs in run.children:
        if rs.state == BLOCKED:
            threads.append(f"  {rs.label} waits " + describe_wait(run, rs))
            name = rs.thread.name if rs.thread is not None else ""
            if isinstance(rs.waiting, Slot) and name.startswith("rpc-"):
                hints.append(f"{rs.label} serves an RPC and waits in a collective: collectives inside RPC "
                             f"handlers are not supported (docs/rpc.md; on real processes the call times out). "
                             f"Fix: issue the collective from the ranks' own code, and have the handler return "
                             f"what it needs")
        elif rs in getattr(run.sched, "requests", ()):  # coop: a thread asking for the turn
            threads.append(f"  {rs.label} waits for the turn to enter an operation")
            holder = run.ranks[rs.rank]
            if timeout and holder.state != DONE and getattr(run.sched, "current", None) is holder:
                hints.append(f"{holder.label} holds the turn while {_held_turn(holder, rs)}")
        elif rs.state != DONE:
            threads.append(f"  {rs.label} is running outside the schedule (a thread the simulator cannot see waiting)")
    lines = [f"{headline} (world_size={run.n}, mode={run.mode!r}, seed={run.seed})"]
    for text in order:
        ranks = groups[text]
        if len(ranks) == 1:
            lines.append(f"  rank {ranks[0]} {text}")
        else:
            verb = text.replace("waits ", "wait ", 1).replace("has ", "have ", 1).replace("is running", "are running", 1).replace("is ready", "are ready", 1)
            lines.append(f"  ranks {_and(ranks)} {verb}")
    send_waiters = [rs.rank for rs in run.ranks
                    if rs.state == BLOCKED and isinstance(rs.waiting, P2PRecord) and rs.waiting.kind == "send"
                    and run.ranks[rs.waiting.dst].state != DONE]  # (a receiver that returned never posts it)
    if send_waiters:
        hints.append(f"rank{'s' if len(send_waiters) > 1 else ''} {_and(send_waiters)} wait{'' if len(send_waiters) > 1 else 's'} "
                     f"in a blocking send until the receiver posts its recv (p2p='rendezvous'): gloo and NCCL do "
                     f"the same, so this program hangs there too; only buffered sends (p2p='eager', MPI-style) "
                     f"would let it through. Fix: post sends with isend (or batch_isend_irecv) before the recvs, "
                     f"or order the send/recv pairs so that one side receives first")
    lines.extend(threads)
    # a p2p operation whose peer has returned or failed: that peer is the cause, whatever else waits
    orphaned: set[int] = set()
    for rs in run.ranks:
        w = rs.waiting if rs.state == BLOCKED else None
        if not isinstance(w, P2PRecord):
            continue
        peer = w.dst if w.kind == "send" else w.src  # (None: a recv from any rank)
        if peer is not None and run.ranks[peer].state == DONE:
            orphaned.add(rs.rank)
            ended = "returned" if run.ranks[peer].exc is None else "failed"
            want = "recv" if w.kind == "send" else "send"
            hints.append(f"rank {peer} {ended} without posting the {want} that matches rank {rs.rank}'s {w.kind} "
                         f"(tag {w.tag}, at {w.site}): a rank-dependent branch, or a batch_isend_irecv list, left "
                         f"it out on rank {peer}")
    cyclic = [r for r in recv_waiters if r not in orphaned]
    if len(cyclic) >= 2:
        both = "both" if len(cyclic) == 2 else "all"
        hints.append(f"ranks {_and(cyclic)} {both} wait in recv: each waits for a send nobody issues")
    # a collective issued inside an autograd backward that another rank never joins
    seen: set[int] = set()
    for rs in run.ranks:
        w = rs.waiting if rs.state == BLOCKED else None
        if not isinstance(w, Slot) or id(w) in seen:
            continue
        seen.add(id(w))
        bw = next((c.backward for c in w.calls if c is not None and c.backward), None)
        arrived = {c.rs.rank for c in w.calls if c is not None}
        for m in w.group.ranks:
            if m in arrived:
                continue
            other = run.ranks[m]
            if bw is not None:
                where = f"the others wait in its {w.name} #{w.seq} on group {group_label(w.group)}"
                if other.state == DONE:
                    hints.append(f"rank {m} returned without running the backward of {bw} ({where}); {_BACKWARD_FIX}")
                elif other.state == BLOCKED:
                    hints.append(f"rank {m} waits elsewhere instead of running the backward of {bw} ({where}); "
                                 f"{_BACKWARD_FIX}")
            if len(hints) > 8:
                break
    hints.extend(_groups_named_apart(run))
    for h in hints:
        lines.append("Hint: " + h)
    which = bound or "timeout"
    if computing:
        who = f"rank {computing[0]} is" if len(computing) == 1 else f"ranks {_and(computing)} are"
        lines.append(f"Fix: {who} still computing, not waiting for another rank: a computation that does not end "
                     f"(an endless loop, a long sleep, a wait on something outside the simulator) is not a "
                     f"collective-order bug; {fix_text(run, which, True)}")
    elif timeout:
        lines.append(f"Fix: {fix_text(run, which, False)}")
    else:
        lines.append("Fix: every member of a group must reach the same collectives in the same order, and every "
                     "recv needs a matching send (same group and tag)")
    return "\n".join(lines)


def _groups_named_apart(run: "Run") -> list[str]:
    """Members of one rank set that wait in different groups torch named differently: a rank skipped a new_group."""
    by_ranks: dict[tuple[int, ...], dict[str, list[int]]] = {}
    for rs in run.ranks:
        w = rs.waiting if rs.state == BLOCKED else None
        name = getattr(getattr(w, "group", None), "torch_name", None)
        if name is not None:
            by_ranks.setdefault(w.group.ranks, {}).setdefault(name, []).append(rs.rank)
    hints = []
    for ranks, names in by_ranks.items():
        if len(names) < 2:
            continue
        where = ", ".join(f"{n!r} on rank{'s' if len(rs) > 1 else ''} {_and(rs)}" for n, rs in names.items())
        if all(_made(run.ranks[r], ranks, n) for r in ranks for n in names):  # every member made every one
            hints.append(f"the members of group {fmt_ranks(ranks)} wait in different groups of the same ranks: "
                         f"the one torch named {where}. Every member made each of these groups, so the ranks "
                         f"passed different group objects to the collective. Fix: pass the same group (the "
                         f"result of the same new_group call) on every member")
            continue
        hints.append(f"the members of group {fmt_ranks(ranks)} wait in different groups: torch named the group "
                     f"{where} (torch names a group by a count of new_group calls, which every rank of the default "
                     f"group makes in the same order, members or not; with use_local_synchronization=True by a hash "
                     f"of its ranks and of how many groups the rank has): ranks that name it differently never "
                     f"meet, and gloo hangs there. Fix: call new_group on every rank, in the same order (a "
                     f"local-synchronization group: on members that have the same groups so far)")
    return hints


def _made(rs: "RankState", ranks: tuple[int, ...], name: str) -> bool:
    """Whether rank ``rs`` made the group of ``ranks`` that torch named ``name``."""
    return (ranks, "torch", name) in getattr(rs.backend, "_member_group_counts", {})


# -- the report of a bound that ran out (see simulator.core.progress) ---------------------------------------------
def _wait_what(run: "Run", a: "RankState", many: bool) -> str:
    if a.state != BLOCKED:
        return f"for {'their' if many else 'its'} turn (coop: one rank computes at a time)"
    w = a.waiting
    name = getattr(w, "name", None) or getattr(w, "kind", None)
    if isinstance(name, str):
        return f"in {name}"
    return describe_wait(run, a)


def stall_headline(run: "Run", waiting: Sequence["RankState"], now: float) -> str:
    """``stall: no operation completed for 300 s while ...; rank 2 has been computing since ...``."""
    by: dict[tuple[bool, str], list["RankState"]] = {}
    for a in waiting:  # grouped by what they wait in (an operation's name, or their turn)
        key = (a.state == BLOCKED, _wait_what(run, a, True))
        by.setdefault(key, []).append(a)
    parts = []
    for actors in by.values():
        roots = [a.rank for a in actors if a.parent is None]
        who = [f"rank{'s' if len(roots) > 1 else ''} {_and(roots)}"] if roots else []
        who += [a.label for a in actors if a.parent is not None][:4]
        many = len(actors) > 1
        parts.append(f"{' and '.join(who)} wait{'' if many else 's'} {_wait_what(run, actors[0], many)}")
    names = run.world.bound_names
    text = (f"stall: no operation completed for {run.stall:g} s ({names.spell('stall', run.stall)}: no rank "
            f"entered or left a call into the simulator meanwhile) while {' and '.join(parts)}")
    computing = [a for a in run.actors if a.state in (RUNNABLE, FREE) and not is_waiting(run, a)][:4]
    for a in computing:
        text += (f"; {a.label} has been computing since {a.stamp - run.started:.1f} s into the run "
                 f"(for {now - a.stamp:.1f} s), at {_where(a)}")
    return text


def timeout_headline(run: "Run") -> str:
    t = run.world.timeout
    return f"timeout: the run did not finish within {t:g} s ({run.world.bound_names.spell('timeout', t)})"


def fix_text(run: "Run", which: str, computing: bool) -> str:
    """The fix of a report: what to look at, and the knob (in the caller's terms) if the program is just slow."""
    names = run.world.bound_names
    value = run.stall if which == "stall" else run.world.timeout
    example = max(2 * value, 3600.0) if value is not None and value < float("inf") else 3600.0
    raise_it = f"raise {names.knob(which)} if it is just slow (e.g. {names.spell(which, example)})"
    if computing:
        return "look at the code shown above, or " + raise_it
    return ("no actor came back into the simulator: look for a wait the simulator cannot see (a lock, a socket, "
            "a child process) in the code of the ranks shown running, or " + raise_it)


#: what torch raises when a program asks for CUDA on a build or machine without it
_NO_CUDA = ("torch._C' has no attribute '_cuda_", "Torch not compiled with CUDA enabled", "Found no NVIDIA driver",
            "No CUDA GPUs are available", "Distributed package doesn't have NCCL built in")


#: what programs raise when rank threads collide on per-process state (singletons, process-wide trackers)
_PROCESS_STATE = ("GlobalHydra is already initialized", "Module hierarchy tracking is wrong",
                  "is already initialized", "already been initialized", "already registered")


def per_process_state(exc: BaseException) -> bool:
    """``exc`` looks like rank threads colliding on state a real process keeps for itself (a failure's hint)."""
    text = str(exc)
    return any(marker in text for marker in _PROCESS_STATE)


def needs_cuda(exc: BaseException) -> bool:
    """``exc`` is what torch raises for a CUDA call without CUDA (a failure's hint names the stand-in)."""
    text = f"{type(exc).__name__}: {exc}"
    return any(marker in text for marker in _NO_CUDA)
