"""Test helper (run as a script): a process that is NOT a member of an RPC world attacks one of its workers.

What a local attacker can do without the world's secret: connect to the
world's rendezvous store (it is not authenticated), read a worker's TensorPipe
address from it, start an agent of its own that names that worker as a peer,
and send it calls.  Usage::

    python tests/_support/rpc_attacker.py PORT VICTIM SIDE_FILE [REPLAY_FILE]

It asks ``VICTIM`` to run ``os.system("touch SIDE_FILE")``; with
``REPLAY_FILE`` it also sends the bytes in that file (a message a member
sealed, captured by the attacker) as a Python call.  It prints one line per
attempt, ``RAN <result>`` or ``REFUSED <error>``, and exits 0 either way
(what counts is the side effect, which the test checks).
"""
from __future__ import annotations

import os
import sys
from datetime import timedelta


def main() -> None:
    port, victim, side = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    replay = sys.argv[4] if len(sys.argv) > 4 else None
    os.environ.pop("TENSORPLAY_RPC_SECRET", None)
    os.environ.pop("TENSORPLAY_RPC_SECRET_FILE", None)
    import torch.distributed as tdist
    import torch.distributed.autograd as tda
    import torch.distributed.rpc as trpc
    from torch.distributed.rpc import api as tapi

    real = tdist.PrefixStore("rpc_prefix_0", tdist.TCPStore("127.0.0.1", port, is_master=False,
                                                             timeout=timedelta(seconds=10)))
    address = real.get(f"addrs/{victim}")
    vrank = int(victim.removeprefix("worker"))  # the pool names its workers worker<rank>
    # a world of its own in which the victim (at its real address) is the peer
    fake = tdist.HashStore()
    fake.set(f"names/{vrank}", victim)
    fake.set(f"addrs/{victim}", address)
    me = 0 if vrank != 0 else 1
    opts = trpc.TensorPipeRpcBackendOptions(rpc_timeout=10, _transports=["uv"], init_method="env://")
    agent = trpc.TensorPipeAgent(fake, "attacker", me, max(me, vrank) + 1, opts, {}, [])
    tda._init(me)
    tapi._init_rpc_states(agent)
    try:
        r = trpc.rpc_sync(victim, os.system, args=(f"touch {side}",))
        print("RAN", r, flush=True)
    except Exception as e:  # noqa: BLE001  the refusal is the expected outcome
        print("REFUSED", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
    if replay is not None:
        from torch._C._distributed_rpc import _invoke_rpc_python_udf

        with open(replay, "rb") as f:
            data = f.read()
        try:
            fut = _invoke_rpc_python_udf(trpc.get_worker_info(victim), data, [], 10.0, False)
            print("RAN", fut.wait(), flush=True)
        except Exception as e:  # noqa: BLE001
            print("REFUSED", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
    sys.stdout.flush()
    os._exit(0)  # the victim never joins this fake world: skip torch's shutdown


if __name__ == "__main__":
    main()
