"""Bad input raises the DistError class the API promises, on sim exactly as on every backend.

One case per validation item; every rank makes the same mistake and must get the same class.
"""
from __future__ import annotations

import pytest
import torch

import simulator
import tensorplay as tp
import tensorplay.distributed as dist
from tensorplay.distributed import (
    DistError,
    DistTypeError,
    DistValueError,
    NotInitializedError,
    RankNotInGroupError,
    ReduceOp,
)


def _not_initialised():
    dist.destroy_process_group()
    dist.all_reduce(tp.ones(1))


def _rank_not_in_group():
    g = dist.new_group([0])
    if dist.get_rank() != 0:  # ranks 1 and 2 are not members
        dist.all_reduce(tp.ones(1), group=g)


def _src_not_in_group():
    g = dist.new_group([0, 1])
    dist.broadcast(tp.ones(1), src=2, group=g)


def _dst_not_in_group():
    g = dist.new_group([1, 2])
    if dist.get_rank() != 0:  # members name a dst outside the group
        dist.reduce(tp.ones(1), dst=0, group=g)


def _group_dst_out_of_range():
    dist.gather(tp.ones(1), None, group_dst=7)


def _list_too_short():
    dist.all_gather([tp.empty(1)], tp.ones(1))


def _scatter_list_wrong_length():
    dist.scatter(tp.empty(1), [tp.ones(1)] * 5, src=0)  # wrong length on src, not allowed off src


def _gather_list_off_root():
    dist.gather(tp.ones(1), [tp.empty(1)] * 3 if dist.get_rank() != 0 else [tp.empty(2)] * 3, dst=0)


def _splits_wrong_sum():
    dist.all_to_all_single(tp.empty(3), tp.ones(3), [1, 1, 1], [1, 1, 2])


def _splits_wrong_length():
    dist.all_to_all_single(tp.empty(3), tp.ones(3), [1, 2], [1, 1, 1])


def _avg_on_int():
    dist.all_reduce(tp.ones(2, dtype=torch.int64), op=ReduceOp.AVG)


def _band_on_float():
    dist.all_reduce(tp.ones(2), op=ReduceOp.BAND)


def _max_on_complex():
    dist.all_reduce(tp.ones(2, dtype=torch.complex64), op=ReduceOp.MAX)


def _tensor_not_a_tensor():
    dist.all_reduce([1.0, 2.0])


def _async_op_not_bool():
    dist.all_reduce(tp.ones(1), async_op="yes")


def _src_not_int():
    dist.broadcast(tp.ones(1), src="0")


def _group_wrong_type():
    dist.all_reduce(tp.ones(1), group=[0, 1, 2])


def _tag_not_int():
    dist.send(tp.ones(1), dst=(dist.get_rank() + 1) % 3, tag=1.5)


def _send_to_self():
    dist.send(tp.ones(1), dst=dist.get_rank())


def _unknown_op():
    dist.all_reduce(tp.ones(1), op="median")


def _output_wrong_shape():
    dist.all_gather_into_tensor(tp.empty(5), tp.ones(2))


def _dtype_differs_in_list():
    dist.all_gather([tp.empty(1), tp.empty(1, dtype=torch.float64), tp.empty(1)], tp.ones(1))


INVOLVED = {"rank_not_in_group": (1, 2), "dst_not_in_group": (1, 2)}  # else every rank

CASES = {
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


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_raises_the_promised_class_on_every_rank(name):
    fn, cls = CASES[name]

    def guarded():
        try:
            fn()
        except DistError as e:
            return type(e), str(e)
        return None, ""

    outs = simulator.run(guarded, 3, timeout=20)
    for r in INVOLVED.get(name, range(3)):
        kind, msg = outs[r]
        assert kind is not None and issubclass(kind, cls), (kind, msg)
        assert not issubclass(kind, simulator.SimError)  # caught by validation, before the simulator ran anything


def test_not_initialised_outside_any_world():
    with pytest.raises(NotInitializedError, match="simulator.run"):
        dist.all_reduce(tp.ones(1))
