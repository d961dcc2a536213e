"""Argument validation: every bad input raises a clear error on the calling rank, before any communication.

Every test runs on each backend of ``tests/_support/backends.py`` through the
``ranks`` fixture.

**One rank makes the mistake** (:data:`CASES`, world sizes 1 and 2): *one*
rank (the "checker") makes every bad call while the other rank does nothing
at all; a call that reached the network would therefore wait for a peer
instead of raising at once.  Afterwards both ranks run one ``all_reduce``
together, which shows that no bad call left a message behind.  One call per
(backend, world size, checker) runs every case; the tests then look at the
recorded ``(error class, MRO, message)`` per case.

Every message must name the collective, the group ranks, the calling rank and
the offending values as ``name=value``.  Expected fragments are templates:
``{r}`` the checker's rank, ``{o}`` the other rank, ``{W}`` the world size,
``{G}`` the world's ranks (e.g. ``[0, 1]``), ``{B}`` the backend's name as
``get_backend()`` reports it.

**Every rank makes the same mistake** (:data:`SAME_MISTAKE`, world size 3):
each must get the promised :class:`DistError` subclass from validation.

**Not initialised** (no backend: the test process itself holds no group).

**Both front doors agree** (:data:`DOOR_CASES`, world size 2): every mistake is
made through ``tensorplay.distributed`` and through its autograd collectives
(``tensorplay.distributed.nn.functional``); both must raise the same class
(:mod:`tensorplay.distributed.validation` states which class each kind of
mistake gets) with the same message shape, and the same message after the
call's name wherever the two doors name the arguments alike.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch

import tensorplay as tp
import tensorplay.distributed as dist
import tensorplay.distributed.nn.functional as df
from tensorplay.distributed import (
    DistError,
    DistTypeError,
    DistValueError,
    NotInitializedError,
    RankNotInGroupError,
    ReduceOp,
)

from _support.backends import Ranks, backend_params, on_backends_with
from _support.torch_refusals import NOT_A_NAME, REFUSED_NAMES, torch_refusal
from _support.worlds import once_per_world


@dataclass
class Ctx:
    """What a bad call may need on the checker rank."""

    rank: int
    W: int
    own_group: Any = None  # new_group([rank]) (world size >= 2)
    other_group: Any = None  # new_group([other]): the checker is not a member

    def t(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(shape or (2,), dtype=dtype)


@dataclass
class Case:
    id: str
    call: Callable[[Ctx], Any]
    error: type
    builtin: type
    fragments: list[str]
    min_world: int = 1
    # a group-type error has no group to name; everything else names it
    names_group: bool = field(default=True)


def _c(id: str, call: Callable[[Ctx], Any], error: type, builtin: type, *fragments: str,  # noqa: A002
       min_world: int = 1, names_group: bool = True) -> Case:
    return Case(id, call, error, builtin, list(fragments), min_world, names_group)


RNIG, DVE, DTE = RankNotInGroupError, DistValueError, DistTypeError
CASES: list[Case] = [
    # -- rank not in group; src/dst not in group --------------------------------------------------
    _c("all_reduce-rank-not-in-group", lambda c: dist.all_reduce(c.t(), group=c.other_group), RNIG, ValueError,
       "group [{o}]", "rank={r}", "group_ranks=[{o}]", min_world=2),
    _c("barrier-rank-not-in-group", lambda c: dist.barrier(group=c.other_group), RNIG, ValueError,
       "group [{o}]", "rank={r}", min_world=2),
    _c("all_to_all-rank-not-in-group", lambda c: dist.all_to_all([c.t()], [c.t()], group=c.other_group), RNIG,
       ValueError, "group [{o}]", "rank={r}", min_world=2),
    _c("broadcast-src-not-in-group", lambda c: dist.broadcast(c.t(), src=1 - c.rank, group=c.own_group), RNIG,
       ValueError, "group [{r}]", "src={o}", "group_ranks=[{r}]", min_world=2),
    _c("broadcast-src-outside-world", lambda c: dist.broadcast(c.t(), src=c.W), RNIG, ValueError,
       "src={W}", "group_ranks={G}"),
    _c("broadcast-group_src-out-of-range", lambda c: dist.broadcast(c.t(), group_src=c.W), RNIG, ValueError,
       "group_src={W}", "group_size={W}"),
    _c("broadcast-src-and-group_src", lambda c: dist.broadcast(c.t(), src=0, group_src=0), DVE, ValueError,
       "src=0", "group_src=0"),
    _c("broadcast-no-src", lambda c: dist.broadcast(c.t()), DVE, ValueError, "src=None"),
    _c("reduce-dst-not-in-group", lambda c: dist.reduce(c.t(), dst=1 - c.rank, group=c.own_group), RNIG,
       ValueError, "group [{r}]", "dst={o}", min_world=2),
    _c("reduce-group_dst-negative", lambda c: dist.reduce(c.t(), group_dst=-1), RNIG, ValueError, "group_dst=-1"),
    _c("gather-dst-outside-world", lambda c: dist.gather(c.t(), None, dst=c.W + 3), RNIG, ValueError,
       "dst={W+3}"),
    _c("gather-group_dst-out-of-range", lambda c: dist.gather(c.t(), None, group_dst=c.W), RNIG, ValueError,
       "group_dst={W}"),
    _c("scatter-src-not-in-group", lambda c: dist.scatter(c.t(), None, src=1 - c.rank, group=c.own_group), RNIG,
       ValueError, "group [{r}]", "src={o}", min_world=2),
    _c("scatter-group_src-out-of-range", lambda c: dist.scatter(c.t(), None, group_src=c.W), RNIG, ValueError,
       "group_src={W}"),
    _c("send-dst-outside-world", lambda c: dist.send(c.t(), dst=c.W), RNIG, ValueError, "dst={W}"),
    _c("send-dst-not-in-group", lambda c: dist.send(c.t(), dst=1 - c.rank, group=c.own_group), RNIG, ValueError,
       "group [{r}]", "dst={o}", min_world=2),
    _c("recv-group_src-out-of-range", lambda c: dist.recv(c.t(), group_src=c.W), RNIG, ValueError,
       "group_src={W}"),
    _c("irecv-src-outside-world", lambda c: dist.irecv(c.t(), src=c.W + 1), RNIG, ValueError, "src={W+1}"),
    _c("send-to-self", lambda c: dist.send(c.t(), dst=c.rank), DVE, ValueError, "dst={r}"),
    # -- list length != group size -------------------------------------------------------------
    _c("all_gather-list-too-long", lambda c: dist.all_gather([c.t() for _ in range(c.W + 1)], c.t()), DVE,
       ValueError, "len(tensor_list)={W+1}", "group_size={W}"),
    _c("gather-list-too-short-on-dst",
       lambda c: dist.gather(c.t(), [c.t() for _ in range(c.W - 1)], dst=c.rank), DVE, ValueError,
       "len(gather_list)={W-1}", "group_size={W}"),
    _c("gather-list-off-dst", lambda c: dist.gather(c.t(), [c.t()], dst=1 - c.rank), DVE, ValueError,
       "dst={o}", "len(gather_list)=1", min_world=2),
    _c("gather-no-list-on-dst", lambda c: dist.gather(c.t(), None, dst=c.rank), DVE, ValueError,
       "gather_list=None"),
    _c("scatter-list-too-long-on-src",
       lambda c: dist.scatter(c.t(), [c.t() for _ in range(c.W + 1)], src=c.rank), DVE, ValueError,
       "len(scatter_list)={W+1}", "group_size={W}"),
    _c("reduce_scatter-list-too-long", lambda c: dist.reduce_scatter(c.t(), [c.t() for _ in range(c.W + 1)]), DVE,
       ValueError, "len(input_list)={W+1}", "group_size={W}"),
    _c("all_to_all-inputs-too-long",
       lambda c: dist.all_to_all([c.t() for _ in range(c.W)], [c.t() for _ in range(c.W + 1)]), DVE, ValueError,
       "len(input_tensor_list)={W+1}", "group_size={W}"),
    _c("all_to_all-outputs-too-short",
       lambda c: dist.all_to_all([c.t() for _ in range(c.W - 1)], [c.t() for _ in range(c.W)]), DVE, ValueError,
       "len(output_tensor_list)={W-1}", "group_size={W}"),
    # -- split sizes -----------------------------------------------------------------------------
    _c("all_to_all_single-input-splits-bad-sum",
       lambda c: dist.all_to_all_single(c.t(2 * c.W), c.t(2 * c.W), None, [2] * (c.W - 1) + [3]), DVE, ValueError,
       "sum(input_split_sizes)={2*W+1}", "input.shape[0]={2*W}"),
    _c("all_to_all_single-input-splits-wrong-length",
       lambda c: dist.all_to_all_single(c.t(2 * c.W), c.t(2 * c.W), None, [2] * c.W + [0]), DVE, ValueError,
       "len(input_split_sizes)={W+1}", "group_size={W}"),
    _c("all_to_all_single-output-splits-bad-sum",
       lambda c: dist.all_to_all_single(c.t(2 * c.W), c.t(2 * c.W), [1] * c.W, None), DVE, ValueError,
       "sum(output_split_sizes)={W}", "output.shape[0]={2*W}"),
    _c("all_to_all_single-negative-split",
       lambda c: dist.all_to_all_single(c.t(2 * c.W), c.t(2 * c.W), None,
                                        [-1] + [2 * c.W + 1] * (c.W > 1) + [0] * max(c.W - 2, 0)),
       DVE, ValueError, "input_split_sizes=[-1"),
    _c("all_to_all_single-indivisible", lambda c: dist.all_to_all_single(c.t(2 * c.W + 1), c.t(2 * c.W + 1)), DVE,
       ValueError, "input.shape[0]={2*W+1}", "group_size={W}", min_world=2),
    _c("all_to_all_single-no-splits-output-of-another-size",
       lambda c: dist.all_to_all_single(c.t(3 * c.W), c.t(2 * c.W)), DVE, ValueError,
       "each tensor's first dimension is split evenly", "output.shape=({3*W},)", "input.shape=({2*W},)"),
    # -- dtype not allowed for the op ------------------------------------------------------------
    _c("all_reduce-AVG-int64", lambda c: dist.all_reduce(c.t(dtype=torch.int64), op=ReduceOp.AVG), DTE, TypeError,
       "op=ReduceOp.AVG", "dtype=torch.int64"),
    _c("all_reduce-AVG-bool", lambda c: dist.all_reduce(c.t(dtype=torch.bool), op=ReduceOp.AVG), DTE, TypeError,
       "op=ReduceOp.AVG", "dtype=torch.bool"),
    _c("all_reduce-BAND-float32", lambda c: dist.all_reduce(c.t(), op=ReduceOp.BAND), DTE, TypeError,
       "op=ReduceOp.BAND", "dtype=torch.float32"),
    _c("all_reduce-BOR-float32", lambda c: dist.all_reduce(c.t(), op=ReduceOp.BOR), DTE, TypeError,
       "op=ReduceOp.BOR", "dtype=torch.float32"),
    _c("all_reduce-BXOR-float32", lambda c: dist.all_reduce(c.t(), op=ReduceOp.BXOR), DTE, TypeError,
       "op=ReduceOp.BXOR", "dtype=torch.float32"),
    _c("all_reduce-MIN-complex64", lambda c: dist.all_reduce(c.t(dtype=torch.complex64), op=ReduceOp.MIN), DTE,
       TypeError, "op=ReduceOp.MIN", "dtype=torch.complex64"),
    _c("all_reduce-MAX-complex64-torch-op",
       lambda c: dist.all_reduce(c.t(dtype=torch.complex64), op=torch.distributed.ReduceOp.MAX), DTE, TypeError,
       "op=ReduceOp.MAX", "dtype=torch.complex64"),
    _c("reduce-AVG-int64", lambda c: dist.reduce(c.t(dtype=torch.int64), dst=0, op=ReduceOp.AVG), DTE, TypeError,
       "op=ReduceOp.AVG", "dtype=torch.int64"),
    _c("reduce_scatter-BXOR-float32",
       lambda c: dist.reduce_scatter(c.t(), [c.t() for _ in range(c.W)], op=ReduceOp.BXOR), DTE, TypeError,
       "op=ReduceOp.BXOR", "dtype=torch.float32"),
    _c("reduce_scatter_tensor-MAX-complex64",
       lambda c: dist.reduce_scatter_tensor(c.t(dtype=torch.complex64), c.t(2 * c.W, dtype=torch.complex64),
                                            op="max"), DTE, TypeError, "op=ReduceOp.MAX", "dtype=torch.complex64"),
    # -- device the backend cannot use (gloo: cpu/cuda; meta stands in for an unusable device) -------------
    _c("all_reduce-meta", lambda c: dist.all_reduce(torch.empty(3, device="meta")), DVE, ValueError,
       "tensor.device='meta'", "backend='{B}'"),
    _c("broadcast-meta", lambda c: dist.broadcast(torch.empty(3, device="meta"), src=0), DVE, ValueError,
       "tensor.device='meta'"),
    _c("all_gather-meta-output",
       lambda c: dist.all_gather([torch.empty(2, device="meta")] + [c.t() for _ in range(c.W - 1)], c.t()), DVE,
       ValueError, "tensor_list[0].device='meta'"),
    _c("all_to_all_single-meta-input", lambda c: dist.all_to_all_single(c.t(c.W), torch.empty(c.W, device="meta")),
       DVE, ValueError, "input.device='meta'"),
    _c("send-meta", lambda c: dist.send(torch.empty(1, device="meta"), dst=c.W - 1 - c.rank), DVE, ValueError,
       "tensor.device='meta'", min_world=2),
    # -- wrong argument types --------------------------------------------------------------------
    _c("all_reduce-tensor-is-list", lambda c: dist.all_reduce([1.0, 2.0]), DTE, TypeError, "tensor='list'"),
    _c("broadcast-tensor-is-float", lambda c: dist.broadcast(3.0, src=0), DTE, TypeError, "tensor='float'"),
    _c("all_gather-list-is-tensor", lambda c: dist.all_gather(c.t(c.W), c.t()), DTE, TypeError,
       "tensor_list='Tensor'"),
    _c("all_reduce-group-is-int", lambda c: dist.all_reduce(c.t(), group=3), DTE, TypeError, "group=3",
       names_group=False),
    _c("all_reduce-op-unknown-name", lambda c: dist.all_reduce(c.t(), op="garbage"), DVE, ValueError,
       "op='garbage'"),
    _c("all_reduce-op-wrong-type", lambda c: dist.all_reduce(c.t(), op=1.5), DTE, TypeError, "op=1.5"),
    _c("broadcast-src-is-str", lambda c: dist.broadcast(c.t(), src="0"), DTE, TypeError, "src='0'"),
    _c("reduce-group_dst-is-float", lambda c: dist.reduce(c.t(), group_dst=0.0), DTE, TypeError, "group_dst=0.0"),
    _c("all_reduce-async_op-int", lambda c: dist.all_reduce(c.t(), async_op=1), DTE, TypeError, "async_op=1"),
    _c("barrier-async_op-str", lambda c: dist.barrier(async_op="yes"), DTE, TypeError, "async_op='yes'"),
    _c("all_to_all_single-splits-floats",
       lambda c: dist.all_to_all_single(c.t(c.W), c.t(c.W), None, [1.0] * c.W), DTE, TypeError,
       "input_split_sizes=[1.0"),
    _c("send-tag-is-str", lambda c: dist.send(c.t(), dst=c.W - 1 - c.rank, tag="x"), DTE, TypeError, "tag='x'",
       min_world=2),
    _c("all_gather_into_tensor-dtype-mismatch",
       lambda c: dist.all_gather_into_tensor(c.t(2 * c.W, dtype=torch.float64), c.t(2)), DTE, TypeError,
       "output_tensor.dtype=torch.float64", "input_tensor.dtype=torch.float32"),
    _c("all_gather_into_tensor-wrong-shape", lambda c: dist.all_gather_into_tensor(c.t(2 * c.W + 1), c.t(2)), DVE,
       ValueError, "output_tensor.shape=({2*W+1},)", "input_tensor.shape=(2,)"),
    _c("reduce_scatter_tensor-wrong-shape", lambda c: dist.reduce_scatter_tensor(c.t(2), c.t(2 * c.W + 1)), DVE,
       ValueError, "input.shape=({2*W+1},)", "output.shape=(2,)"),
]
CASE_BY_ID = {case.id: case for case in CASES}
assert len(CASE_BY_ID) == len(CASES), "case ids must be unique"


# -- on the ranks ------------------------------------------------------------------------------
def _groups(rank: int, world: int) -> tuple[Any, Any]:
    """(own group, other rank's group); every rank creates new_group([0]) then new_group([1]), once per world."""
    if world < 2:
        return None, None
    singles = once_per_world("bad_input.singles", lambda: [dist.new_group([r]) for r in range(world)])
    return singles[rank], singles[1 - rank]


def _run_bad_calls(checker: int, case_ids: list[str]) -> dict[str, Any]:
    """The checker makes every bad call; the other rank does nothing; then both all-reduce once."""
    rank, world = dist.get_rank(), dist.get_world_size()
    own, other = _groups(rank, world)
    records: dict[str, Any] = {}
    if rank == checker:
        ctx = Ctx(rank, world, own, other)
        for cid in case_ids:
            t0 = time.monotonic()
            try:
                CASE_BY_ID[cid].call(ctx)
            except BaseException as e:  # noqa: BLE001  every outcome is recorded
                records[cid] = (type(e).__name__, [k.__name__ for k in type(e).__mro__], str(e),
                                time.monotonic() - t0)
            else:
                records[cid] = ("no error", [], "", time.monotonic() - t0)
    health = torch.tensor([float(rank + 1)])
    dist.all_reduce(health)
    records["__health__"] = float(health.item())
    records["__backend__"] = dist.get_backend()
    return records


# -- in the test process -----------------------------------------------------------------------
_RESULTS: dict[tuple[str, int, int], dict[str, Any]] = {}


def _results(ranks: Ranks, checker: int) -> dict[str, Any]:
    """One call per (backend, world size, checker), shared by every test of that triple (also under xdist)."""
    key = (ranks.name, ranks.world_size, checker)
    if key not in _RESULTS:
        ids = [c.id for c in CASES if c.min_world <= ranks.world_size]
        per_rank = ranks.run(_run_bad_calls, checker, ids)
        _RESULTS[key] = per_rank[checker] | {"__health_all__": [r["__health__"] for r in per_rank]}
    return _RESULTS[key]


def _checker_cases(world: int) -> list[tuple[int, str]]:
    return [(checker, case.id) for checker in range(world) for case in CASES if case.min_world <= world]


def _fill(template: str, world: int, rank: int, backend: str) -> str:
    return template.format(r=rank, o=1 - rank, W=world, G=list(range(world)), B=backend, **{
        "W+1": world + 1, "W-1": world - 1, "W+3": world + 3, "2*W": 2 * world, "2*W+1": 2 * world + 1,
        "3*W": 3 * world})


#: the name ``get_backend()`` reports on each backend (and that messages name)
BACKEND_NAME = {"sim": "sim", "gloo": "gloo"}


@on_backends_with("checker_case", _checker_cases, lambda v: f"rank{v[0]}-{v[1]}", (1, 2))
def test_bad_call_raises_before_communicating(ranks: Ranks, checker_case: tuple[int, str]) -> None:
    checker, case_id = checker_case
    world = ranks.world_size
    case = CASE_BY_ID[case_id]
    results = _results(ranks, checker)
    name, mro, message, seconds = results[case_id]
    where = f"{ranks.name} W={world} rank={checker} case={case_id}: {name}: {message}"
    assert results["__backend__"] == ranks.expected(BACKEND_NAME), where
    assert name == case.error.__name__, where
    assert case.builtin.__name__ in mro and "DistError" in mro, where
    collective = case_id.split("-")[0]
    assert message.startswith(f"tensorplay.distributed.{collective} ("), where
    assert f"rank {checker}" in message, where
    if case.names_group:
        assert "group [" in message, where
    for fragment in case.fragments:
        assert _fill(fragment, world, checker, results["__backend__"]) in message, where
    assert "Fix:" in message, where
    assert seconds < 5.0, f"{where} (took {seconds:.1f}s: it waited for a peer instead of failing at once)"


@on_backends_with("checker", range, lambda c: f"rank{c}", (1, 2))
def test_world_still_healthy_after_bad_calls(ranks: Ranks, checker: int) -> None:
    """No bad call sent anything: the all-reduce that follows them sees exactly the ranks' own values."""
    world = ranks.world_size
    assert _results(ranks, checker)["__health_all__"] == [world * (world + 1) / 2] * world


# -- not initialised: no pool, this process never initialised a process group ----------------------
NOT_INITIALISED = [
    ("all_reduce", lambda: dist.all_reduce(torch.ones(1))),
    ("barrier", lambda: dist.barrier()),
    ("broadcast", lambda: dist.broadcast(torch.ones(1), src=0)),
    ("all_to_all_single", lambda: dist.all_to_all_single(torch.ones(1), torch.ones(1))),
    ("send", lambda: dist.send(torch.ones(1), dst=1)),
    ("recv", lambda: dist.recv(torch.ones(1))),
    ("get_rank", lambda: dist.get_rank()),
    ("new_group", lambda: dist.new_group([0])),
]


@pytest.mark.parametrize("name,call", NOT_INITIALISED, ids=[n for n, _ in NOT_INITIALISED])
def test_not_initialised(name: str, call: Callable[[], Any]) -> None:
    assert not dist.is_initialized(), "the test process must not hold a process group"
    with pytest.raises(NotInitializedError) as info:
        call()
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, DistError)
    message = str(info.value)
    assert message.startswith(f"tensorplay.distributed.{name}: ")
    assert "init_process_group" in message and "Fix:" in message


def test_not_initialised_outside_any_world() -> None:
    """The message names the ways to get a world, the simulator's included."""
    with pytest.raises(NotInitializedError, match="simulator.run"):
        dist.all_reduce(tp.ones(1))


# -- backend names: refused as torch refuses them (torch's class, torch's message first) ----------------------
#: names torch's init_process_group refuses: misspelt, empty, a bad device:backend string, not a string
REFUSED_BACKENDS: list[Any] = REFUSED_NAMES + NOT_A_NAME
#: names it accepts (whether the backend is available is another question), and "sim", tensorplay's own
ACCEPTED_BACKENDS: list[Any] = ["gloo", "GLOO", "nccl", "cpu:gloo,cuda:nccl", "sim", None]


def _init_outcomes(names: list[Any]) -> dict[str, Any]:
    """``init_process_group(name)`` for each name: None, or (class, is AssertionError, is DistError, message)."""
    out: dict[str, Any] = {}
    for b in names:
        try:
            dist.init_process_group(b)
            out[repr(b)] = None
            dist.destroy_process_group()  # (a second init without it is refused, as on gloo: each name on its own)
        except Exception as e:  # noqa: BLE001
            out[repr(b)] = (type(e).__name__, isinstance(e, AssertionError), isinstance(e, DistError), str(e))
    if not dist.is_initialized():
        dist.init_process_group("gloo")  # the rank ends joined, as it started
    return out


@pytest.mark.parametrize("backend", REFUSED_BACKENDS, ids=repr)
def test_a_backend_name_torch_refuses_is_refused_before_any_rendezvous(backend: Any) -> None:
    """No MASTER_ADDR, no store: the name is checked first (torch checks it after the rendezvous)."""
    assert not dist.is_initialized(), "the test process must not hold a process group"
    kind, torch_says = torch_refusal(backend)
    with pytest.raises(kind) as info:
        dist.init_process_group(backend)
    message = re.sub(r"\s+", " ", str(info.value))
    assert isinstance(info.value, DistError), message
    assert message.startswith(torch_says + "; tensorplay.distributed.init_process_group: "), (torch_says, message)
    assert f"backend={backend!r}" in message and "Fix:" in message, message
    assert not dist.is_initialized()


def test_a_misspelt_backend_gets_the_closest_name() -> None:
    with pytest.raises(AssertionError, match=r"^Unknown backend type glooo; .*known=\['gloo', 'nccl', 'sim'\]\. "
                                             r"Fix: did you mean 'gloo'\?"):
        dist.init_process_group("glooo")
    with pytest.raises(AssertionError, match="Fix: a comma separates device:backend pairs"):
        dist.init_process_group("gloo,nccl")


def test_a_name_torch_knows_that_tensorplay_does_not_run_stays_unknown() -> None:
    with pytest.raises(DistValueError, match=r"unknown backend: backend='mpi', available=\['gloo', 'nccl', 'sim'\]"):
        dist.init_process_group("mpi")


@on_backends_with("checker", range, lambda c: f"rank{c}", (1, 2))
def test_init_process_group_in_a_running_world_refuses_what_torch_refuses(ranks: Ranks, checker: int) -> None:
    """A simulated world is started for the program, so calling init_process_group in it is allowed (it joins the
    world), yet the name is checked as a fresh torchrun process checks it.  The gloo pool's ranks hold a process
    group already: there a second init_process_group is refused first, whatever the name (as torch does)."""
    outs = ranks.run(_init_outcomes, REFUSED_BACKENDS + ACCEPTED_BACKENDS)
    first = ranks.expected({"sim": "the name", "gloo": "already initialised"})
    for r, got in enumerate(outs):
        where = f"{ranks} rank {r}"
        for b in REFUSED_BACKENDS + ACCEPTED_BACKENDS:
            outcome = got[repr(b)]
            if first == "already initialised":
                assert outcome[0] == "DistRuntimeError" and "already initialised" in outcome[3], (where, b, outcome)
            elif b in ACCEPTED_BACKENDS:
                assert outcome is None, (where, b, outcome)
            else:
                kind, torch_says = torch_refusal(b)
                name, is_assertion, is_dist, message = outcome
                assert is_dist and is_assertion == issubclass(kind, AssertionError), (where, b, outcome)
                assert re.sub(r"\s+", " ", message).startswith(torch_says + "; "), (where, b, torch_says, message)


# -- every rank makes the same mistake (world size 3) --------------------------------------------
def _not_initialised() -> None:
    dist.destroy_process_group()
    dist.all_reduce(tp.ones(1))


def _rank_not_in_group() -> None:
    g = dist.new_group([0])
    if dist.get_rank() != 0:  # ranks 1 and 2 are not members
        dist.all_reduce(tp.ones(1), group=g)


def _src_not_in_group() -> None:
    g = dist.new_group([0, 1])
    dist.broadcast(tp.ones(1), src=2, group=g)


def _dst_not_in_group() -> None:
    g = dist.new_group([1, 2])
    if dist.get_rank() != 0:  # members name a dst outside the group
        dist.reduce(tp.ones(1), dst=0, group=g)


def _group_dst_out_of_range() -> None:
    dist.gather(tp.ones(1), None, group_dst=7)


def _list_too_short() -> None:
    dist.all_gather([tp.empty(1)], tp.ones(1))


def _scatter_list_wrong_length() -> None:
    dist.scatter(tp.empty(1), [tp.ones(1)] * 5, src=0)  # wrong length on src, not allowed off src


def _gather_list_off_root() -> None:
    dist.gather(tp.ones(1), [tp.empty(1)] * 3 if dist.get_rank() != 0 else [tp.empty(2)] * 3, dst=0)


def _splits_wrong_sum() -> None:
    dist.all_to_all_single(tp.empty(3), tp.ones(3), [1, 1, 1], [1, 1, 2])


def _splits_wrong_length() -> None:
    dist.all_to_all_single(tp.empty(3), tp.ones(3), [1, 2], [1, 1, 1])


def _avg_on_int() -> None:
    dist.all_reduce(tp.ones(2, dtype=torch.int64), op=ReduceOp.AVG)


def _band_on_float() -> None:
    dist.all_reduce(tp.ones(2), op=ReduceOp.BAND)


def _max_on_complex() -> None:
    dist.all_reduce(tp.ones(2, dtype=torch.complex64), op=ReduceOp.MAX)


def _tensor_not_a_tensor() -> None:
    dist.all_reduce([1.0, 2.0])


def _async_op_not_bool() -> None:
    dist.all_reduce(tp.ones(1), async_op="yes")


def _src_not_int() -> None:
    dist.broadcast(tp.ones(1), src="0")


def _group_wrong_type() -> None:
    dist.all_reduce(tp.ones(1), group=[0, 1, 2])


def _tag_not_int() -> None:
    dist.send(tp.ones(1), dst=(dist.get_rank() + 1) % 3, tag=1.5)


def _send_to_self() -> None:
    dist.send(tp.ones(1), dst=dist.get_rank())


def _unknown_op() -> None:
    dist.all_reduce(tp.ones(1), op="median")


def _output_wrong_shape() -> None:
    dist.all_gather_into_tensor(tp.empty(5), tp.ones(2))


def _dtype_differs_in_list() -> None:
    dist.all_gather([tp.empty(1), tp.empty(1, dtype=torch.float64), tp.empty(1)], tp.ones(1))


INVOLVED = {"rank_not_in_group": (1, 2), "dst_not_in_group": (1, 2)}  # else every rank

SAME_MISTAKE: dict[str, tuple[Callable[[], None], type]] = {
    "not_initialised": (_not_initialised, NotInitializedError),
    "rank_not_in_group": (_rank_not_in_group, RankNotInGroupError),
    "src_not_in_group": (_src_not_in_group, RankNotInGroupError),
    "dst_not_in_group": (_dst_not_in_group, RankNotInGroupError),
    "group_dst_out_of_range": (_group_dst_out_of_range, RankNotInGroupError),
    "list_length_not_group_size": (_list_too_short, DistValueError),
    "scatter_list_wrong_length": (_scatter_list_wrong_length, DistValueError),
    "gather_list_off_root": (_gather_list_off_root, DistValueError),
    "splits_wrong_sum": (_splits_wrong_sum, DistValueError),
    "splits_wrong_length": (_splits_wrong_length, DistValueError),
    "avg_on_int": (_avg_on_int, DistTypeError),
    "band_on_float": (_band_on_float, DistTypeError),
    "max_on_complex": (_max_on_complex, DistTypeError),
    "tensor_not_a_tensor": (_tensor_not_a_tensor, DistTypeError),
    "async_op_not_bool": (_async_op_not_bool, DistTypeError),
    "src_not_int": (_src_not_int, DistTypeError),
    "group_wrong_type": (_group_wrong_type, DistTypeError),
    "tag_not_int": (_tag_not_int, DistTypeError),
    "send_to_self": (_send_to_self, DistValueError),
    "unknown_op": (_unknown_op, DistValueError),
    "output_wrong_shape": (_output_wrong_shape, DistValueError),
    "dtype_differs_in_list": (_dtype_differs_in_list, DistTypeError),
}

#: backends on which a case cannot run, and why (the check stays visible as a skip)
SAME_MISTAKE_SKIP = {
    "not_initialised": {"gloo": "destroy_process_group would tear down the pool's process group that the "
                                "session's later gloo tests reuse; the not-initialised error is checked "
                                "without any group by test_not_initialised"},
}


def _guarded(name: str) -> tuple[type | None, str]:
    try:
        SAME_MISTAKE[name][0]()
    except DistError as e:
        return type(e), str(e)
    return None, ""


def _same_mistake_params() -> list[Any]:
    out = []
    for name in SAME_MISTAKE:
        for p in backend_params((3,), skip=SAME_MISTAKE_SKIP.get(name)):
            out.append(pytest.param(p.values[0], name, id=f"{name}-{p.id}", marks=p.marks))
    return out


@pytest.mark.parametrize("ranks,name", _same_mistake_params(), indirect=["ranks"])
def test_bad_input_raises_the_promised_class_on_every_rank(ranks: Ranks, name: str) -> None:
    cls = SAME_MISTAKE[name][1]
    outs = ranks.run(_guarded, name)
    for r in INVOLVED.get(name, range(3)):
        kind, msg = outs[r]
        assert kind is not None and issubclass(kind, cls), (ranks, r, kind, msg)
        if ranks.simulated:
            import simulator

            # caught by validation, before the simulator ran anything
            assert not issubclass(kind, simulator.SimError), (ranks, r, kind, msg)


# -- the two front doors agree: dist.<call> and nn.functional.<call> raise one class per mistake ------------
@dataclass(frozen=True)
class DoorCase:
    """One mistake made through both doors: ``api`` (torch.distributed's signatures) and ``functional``
    (the autograd collectives).  ``same_text``: the doors name the arguments alike, so the messages must
    agree after the call's name."""

    id: str
    api: Callable[[Ctx], Any]
    functional: Callable[[Ctx], Any]
    error: type
    same_text: bool = True
    min_world: int = 1
    names_group: bool = True


def _d(id: str, api: Callable[[Ctx], Any], functional: Callable[[Ctx], Any], error: type,  # noqa: A002
       same_text: bool = True, min_world: int = 1, names_group: bool = True) -> DoorCase:
    return DoorCase(id, api, functional, error, same_text, min_world, names_group)


def _f64(c: Ctx, *shape: int) -> torch.Tensor:
    return c.t(*shape, dtype=torch.float64)


#: every rank makes the same calls, so a call that wrongly passed would run on every rank instead of hanging
DOOR_CASES: list[DoorCase] = [
    # -- the reduce op: a wrong type (torch: all_reduce(x, op=3) is a TypeError), an unknown name, a dtype --
    _d("all_reduce-op-is-int", lambda c: dist.all_reduce(c.t(), op=3), lambda c: df.all_reduce(c.t(), op=3), DTE),
    _d("all_reduce-op-is-float", lambda c: dist.all_reduce(c.t(), op=1.5), lambda c: df.all_reduce(c.t(), op=1.5),
       DTE),
    _d("all_reduce-op-is-None", lambda c: dist.all_reduce(c.t(), op=None), lambda c: df.all_reduce(c.t(), op=None),
       DTE),
    _d("reduce-op-is-int", lambda c: dist.reduce(c.t(), dst=0, op=3), lambda c: df.reduce(c.t(), dst=0, op=3), DTE),
    _d("reduce_scatter-op-is-int", lambda c: dist.reduce_scatter(c.t(), [c.t()] * c.W, op=3),
       lambda c: df.reduce_scatter(c.t(), [c.t()] * c.W, op=3), DTE),
    _d("all_reduce-op-unknown-name", lambda c: dist.all_reduce(c.t(), op="median"),
       lambda c: df.all_reduce(c.t(), op="median"), DVE),
    _d("all_reduce-op-torch-PREMUL_SUM", lambda c: dist.all_reduce(c.t(), op=torch.distributed.ReduceOp.PREMUL_SUM),
       lambda c: df.all_reduce(c.t(), op=torch.distributed.ReduceOp.PREMUL_SUM), DVE),
    _d("all_reduce-AVG-int64", lambda c: dist.all_reduce(c.t(dtype=torch.int64), op=ReduceOp.AVG),
       lambda c: df.all_reduce(c.t(dtype=torch.int64), op=ReduceOp.AVG), DTE),
    _d("all_reduce-BAND-float32", lambda c: dist.all_reduce(c.t(), op=ReduceOp.BAND),
       lambda c: df.all_reduce(c.t(), op=ReduceOp.BAND), DTE),
    _d("reduce-MAX-complex64", lambda c: dist.reduce(c.t(dtype=torch.complex64), dst=0, op="max"),
       lambda c: df.reduce(c.t(dtype=torch.complex64), dst=0, op="max"), DTE),
    # -- tensors: the wrong type, a device the backend cannot use --
    _d("all_reduce-tensor-is-list", lambda c: dist.all_reduce([1.0, 2.0]), lambda c: df.all_reduce([1.0, 2.0]), DTE),
    _d("broadcast-tensor-is-float", lambda c: dist.broadcast(3.0, src=0), lambda c: df.broadcast(3.0, src=0), DTE),
    _d("all_gather-tensor-is-int", lambda c: dist.all_gather([c.t()] * c.W, 5), lambda c: df.all_gather(5), DTE),
    _d("all_reduce-meta", lambda c: dist.all_reduce(torch.empty(3, device="meta")),
       lambda c: df.all_reduce(torch.empty(3, device="meta")), DVE),
    # -- roots: the wrong type, outside the group, both forms, none --
    _d("broadcast-src-is-str", lambda c: dist.broadcast(c.t(), src="0"), lambda c: df.broadcast(c.t(), src="0"), DTE),
    _d("reduce-group_dst-is-float", lambda c: dist.reduce(c.t(), group_dst=0.0),
       lambda c: df.reduce(c.t(), group_dst=0.0), DTE),
    _d("broadcast-src-outside-world", lambda c: dist.broadcast(c.t(), src=c.W),
       lambda c: df.broadcast(c.t(), src=c.W), RNIG),
    _d("broadcast-group_src-out-of-range", lambda c: dist.broadcast(c.t(), group_src=c.W),
       lambda c: df.broadcast(c.t(), group_src=c.W), RNIG),
    _d("gather-dst-outside-world", lambda c: dist.gather(c.t(), None, dst=c.W + 3),
       lambda c: df.gather(c.t(), dst=c.W + 3), RNIG),
    _d("scatter-src-outside-world", lambda c: dist.scatter(c.t(), None, src=c.W), lambda c: df.scatter(None, src=c.W),
       RNIG),
    _d("broadcast-src-not-in-group", lambda c: dist.broadcast(c.t(), src=1 - c.rank, group=c.own_group),
       lambda c: df.broadcast(c.t(), src=1 - c.rank, group=c.own_group), RNIG, min_world=2),
    _d("broadcast-src-and-group_src", lambda c: dist.broadcast(c.t(), src=0, group_src=0),
       lambda c: df.broadcast(c.t(), src=0, group_src=0), DVE),
    _d("broadcast-no-src", lambda c: dist.broadcast(c.t()), lambda c: df.broadcast(c.t()), DVE),
    _d("reduce-no-dst", lambda c: dist.reduce(c.t()), lambda c: df.reduce(c.t()), DVE),
    # -- lists: the wrong type, the wrong length, entries that do not match --
    _d("reduce_scatter-list-is-tensor", lambda c: dist.reduce_scatter(c.t(), c.t(c.W)),
       lambda c: df.reduce_scatter(c.t(), c.t(c.W)), DTE),
    _d("reduce_scatter-list-too-long", lambda c: dist.reduce_scatter(c.t(), [c.t()] * (c.W + 1)),
       lambda c: df.reduce_scatter(c.t(), [c.t()] * (c.W + 1)), DVE),
    _d("reduce_scatter-entry-dtype", lambda c: dist.reduce_scatter(c.t(), [_f64(c)] * c.W),
       lambda c: df.reduce_scatter(c.t(), [_f64(c)] * c.W), DTE),
    _d("reduce_scatter-entry-shape", lambda c: dist.reduce_scatter(c.t(), [c.t(3)] * c.W),
       lambda c: df.reduce_scatter(c.t(), [c.t(3)] * c.W), DVE),
    _d("all_to_all-inputs-too-long", lambda c: dist.all_to_all([c.t()] * c.W, [c.t()] * (c.W + 1)),
       lambda c: df.all_to_all([c.t()] * c.W, [c.t()] * (c.W + 1)), DVE),
    _d("all_to_all-outputs-too-short", lambda c: dist.all_to_all([c.t()] * (c.W - 1), [c.t()] * c.W),
       lambda c: df.all_to_all([c.t()] * (c.W - 1), [c.t()] * c.W), DVE),
    _d("all_to_all-output-dtype", lambda c: dist.all_to_all([_f64(c)] * c.W, [c.t()] * c.W),
       lambda c: df.all_to_all([_f64(c)] * c.W, [c.t()] * c.W), DTE),
    _d("all_to_all-self-block-shape",
       lambda c: dist.all_to_all([c.t(3 if i == c.rank else 2) for i in range(c.W)], [c.t()] * c.W),
       lambda c: df.all_to_all([c.t(3 if i == c.rank else 2) for i in range(c.W)], [c.t()] * c.W), DVE),
    # every rank is src of its own one-rank group: the call fails on each without a peer
    _d("scatter-list-too-long-on-src", lambda c: dist.scatter(c.t(), [c.t()] * 2, group=c.own_group, group_src=0),
       lambda c: df.scatter([c.t()] * 2, group=c.own_group, group_src=0), DVE, same_text=False, min_world=2),
    _d("scatter-no-list-on-src", lambda c: dist.scatter(c.t(), None, group=c.own_group, group_src=0),
       lambda c: df.scatter(None, group=c.own_group, group_src=0), DVE, same_text=False, min_world=2),
    # -- split sizes and shapes --
    _d("all_to_all_single-splits-bad-sum",
       lambda c: dist.all_to_all_single(c.t(2 * c.W), c.t(2 * c.W), None, [2] * (c.W - 1) + [3]),
       lambda c: df.all_to_all_single(c.t(2 * c.W), c.t(2 * c.W), None, [2] * (c.W - 1) + [3]), DVE),
    _d("all_to_all_single-splits-wrong-length",
       lambda c: dist.all_to_all_single(c.t(2 * c.W), c.t(2 * c.W), None, [2] * c.W + [0]),
       lambda c: df.all_to_all_single(c.t(2 * c.W), c.t(2 * c.W), None, [2] * c.W + [0]), DVE),
    _d("all_to_all_single-splits-negative",
       lambda c: dist.all_to_all_single(c.t(c.W), c.t(c.W), None, [-1] + [1] * (c.W - 2) + [2]),
       lambda c: df.all_to_all_single(c.t(c.W), c.t(c.W), None, [-1] + [1] * (c.W - 2) + [2]), DVE),
    _d("all_to_all_single-splits-floats", lambda c: dist.all_to_all_single(c.t(c.W), c.t(c.W), None, [1.0] * c.W),
       lambda c: df.all_to_all_single(c.t(c.W), c.t(c.W), None, [1.0] * c.W), DTE),
    # the autograd door sizes a missing output from the splits: it must check them before adding them up
    _d("all_to_all_single-output-splits-floats",
       lambda c: dist.all_to_all_single(c.t(c.W), c.t(c.W), [1.0] * c.W, None),
       lambda c: df.all_to_all_single(None, c.t(c.W), [1.0] * c.W, None), DTE),
    _d("all_to_all_single-indivisible", lambda c: dist.all_to_all_single(c.t(c.W + 1), c.t(c.W + 1)),
       lambda c: df.all_to_all_single(c.t(c.W + 1), c.t(c.W + 1)), DVE, min_world=2),
    _d("all_to_all_single-trailing-shape", lambda c: dist.all_to_all_single(c.t(c.W, 3), c.t(c.W, 2)),
       lambda c: df.all_to_all_single(c.t(c.W, 3), c.t(c.W, 2)), DVE),
    _d("all_to_all_single-output-dtype", lambda c: dist.all_to_all_single(_f64(c, c.W), c.t(c.W)),
       lambda c: df.all_to_all_single(_f64(c, c.W), c.t(c.W)), DTE),
    _d("all_gather_into_tensor-wrong-shape", lambda c: dist.all_gather_into_tensor(c.t(2 * c.W + 1), c.t(2)),
       lambda c: df.all_gather_single(c.t(2 * c.W + 1), c.t(2)), DVE, same_text=False),
    _d("all_gather_into_tensor-output-dtype", lambda c: dist.all_gather_into_tensor(_f64(c, 2 * c.W), c.t(2)),
       lambda c: df.all_gather_single(_f64(c, 2 * c.W), c.t(2)), DTE, same_text=False),
    # -- the group: the wrong type, a group the calling rank is not in --
    _d("all_reduce-group-is-int", lambda c: dist.all_reduce(c.t(), group=3), lambda c: df.all_reduce(c.t(), group=3),
       DTE, names_group=False),
    _d("all_reduce-group-is-list", lambda c: dist.all_reduce(c.t(), group=[0, 1]),
       lambda c: df.all_reduce(c.t(), group=[0, 1]), DTE, names_group=False),
    _d("all_reduce-rank-not-in-group", lambda c: dist.all_reduce(c.t(), group=c.other_group),
       lambda c: df.all_reduce(c.t(), group=c.other_group), RNIG, min_world=2),
]
DOOR_BY_ID = {case.id: case for case in DOOR_CASES}
assert len(DOOR_BY_ID) == len(DOOR_CASES), "door case ids must be unique"
#: the mistakes the agreement test must cover (a kind dropped from DOOR_CASES fails the suite)
DOOR_KINDS = ("op-is-int", "op-unknown-name", "tensor-is-list", "src-outside-world", "list-too-long",
              "group-is-int", "rank-not-in-group")


def _outcome(call: Callable[[], Any]) -> tuple[str, list[str], str]:
    try:
        call()
    except BaseException as e:  # noqa: BLE001  every outcome is recorded
        return type(e).__name__, [k.__name__ for k in type(e).__mro__], str(e)
    return "no error", [], ""


def _run_door_calls(case_ids: list[str]) -> dict[str, Any]:
    """Every rank makes every mistake through both doors, then all ranks all-reduce once."""
    rank, world = dist.get_rank(), dist.get_world_size()
    own, other = _groups(rank, world)
    ctx = Ctx(rank, world, own, other)
    records: dict[str, Any] = {}
    for cid in case_ids:
        case = DOOR_BY_ID[cid]
        records[cid] = (_outcome(lambda: case.api(ctx)), _outcome(lambda: case.functional(ctx)))
    health = torch.tensor([float(rank + 1)])
    dist.all_reduce(health)
    records["__health__"] = float(health.item())
    return records


_DOOR_RESULTS: dict[tuple[str, int], list[dict[str, Any]]] = {}


def _door_results(ranks: Ranks) -> list[dict[str, Any]]:
    """One call per (backend, world size), shared by every case."""
    key = (ranks.name, ranks.world_size)
    if key not in _DOOR_RESULTS:
        ids = [c.id for c in DOOR_CASES if c.min_world <= ranks.world_size]
        _DOOR_RESULTS[key] = ranks.run(_run_door_calls, ids)
    return _DOOR_RESULTS[key]


_HEAD = re.compile(r"^tensorplay\.distributed\.(?P<door>nn\.functional\.)?(?P<call>\w+)(?P<rest>.*)$", re.S)


def test_the_door_cases_cover_every_kind_of_mistake() -> None:
    missing = [kind for kind in DOOR_KINDS if not any(c.id.endswith(kind) for c in DOOR_CASES)]
    assert not missing, missing
    assert {c.error for c in DOOR_CASES} == {DTE, DVE, RNIG}


@on_backends_with("case_id", lambda w: [c.id for c in DOOR_CASES if c.min_world <= w], str, (2,))
def test_both_front_doors_raise_the_same_class_for_the_same_mistake(ranks: Ranks, case_id: str) -> None:
    case = DOOR_BY_ID[case_id]
    per_rank = _door_results(ranks)
    call = case_id.split("-")[0]
    for rank, records in enumerate(per_rank):
        (api_cls, api_mro, api_msg), (fn_cls, fn_mro, fn_msg) = records[case_id]
        where = f"{ranks} rank {rank} case={case_id}:\n  dist: {api_cls}: {api_msg}\n  df:   {fn_cls}: {fn_msg}"
        assert api_cls == fn_cls == case.error.__name__, where
        assert "DistError" in api_mro and "DistError" in fn_mro, where
        api_head, fn_head = _HEAD.match(api_msg), _HEAD.match(fn_msg)
        assert api_head and not api_head["door"] and api_head["call"] == call, where
        assert fn_head and fn_head["door"], where
        for head in (api_head, fn_head):
            rest = head["rest"]
            assert rest.startswith(" (") and f"rank {rank})" in rest.split(":", 1)[0], where
            assert ("group [" in rest.split(":", 1)[0]) == case.names_group, where
            assert "=" in rest and ". Fix: " in rest, where
        if case.same_text:
            assert fn_head["call"] == call and api_head["rest"] == fn_head["rest"], where
    assert [r["__health__"] for r in per_rank] == [3.0, 3.0], "a refused call left a message behind"


#: both doors outside any world: the state mistake (no process group) is the same class through both
OUTSIDE_A_WORLD = [
    ("all_reduce", lambda: dist.all_reduce(torch.ones(1)), lambda: df.all_reduce(torch.ones(1))),
    ("broadcast", lambda: dist.broadcast(torch.ones(1), src=0), lambda: df.broadcast(torch.ones(1), src=0)),
    ("all_to_all_single", lambda: dist.all_to_all_single(torch.ones(1), torch.ones(1)),
     lambda: df.all_to_all_single(None, torch.ones(1))),
]


@pytest.mark.parametrize("name,api,functional", OUTSIDE_A_WORLD, ids=[n for n, _, _ in OUTSIDE_A_WORLD])
def test_both_front_doors_refuse_outside_a_world_alike(name: str, api: Callable[[], Any],
                                                      functional: Callable[[], Any]) -> None:
    assert not dist.is_initialized(), "the test process must not hold a process group"
    (api_cls, _, api_msg), (fn_cls, _, fn_msg) = _outcome(api), _outcome(functional)
    assert api_cls == fn_cls == "NotInitializedError", (api_msg, fn_msg)
    assert api_msg.startswith(f"tensorplay.distributed.{name}: ")
    assert fn_msg.startswith(f"tensorplay.distributed.nn.functional.{name}: ")
    assert api_msg.split(": ", 1)[1] == fn_msg.split(": ", 1)[1]


def _all_reduce_expanded() -> str:
    try:
        dist.all_reduce(torch.ones(1).expand(3))
    except dist.DistBackendError as e:
        return str(e)
    return "not refused"


def test_an_output_whose_elements_share_memory_names_the_clone_fix() -> None:
    """An expanded view (stride 0) cannot take a collective's result element by element: the failure says so and
    names the fix, not a device mix-up."""
    import simulator

    for msg in simulator.run(_all_reduce_expanded, 2, timeout=60):
        assert "refers to a single memory location" in msg and "Fix: pass output tensors whose elements have " \
            "memory of their own: t.contiguous() or t.clone()" in msg, msg
