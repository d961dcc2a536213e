"""Test helper (run as a script): one TensorPipe RPC member that starts, makes one call, and reports.

    python tests/_support/rpc_member.py RANK WORLD_SIZE PORT RPC_TIMEOUT

The secret (if any) comes from the environment, as for any member.  Prints ``OK <result>`` or
``ERR <type>: <message>`` on one line and exits 0.
"""
from __future__ import annotations

import sys


def main() -> None:
    rank, world_size, port, timeout = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    import tensorplay.distributed.rpc as rpc

    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=timeout,
                                           _transports=["uv"])
    try:
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
        out = rpc.rpc_sync(f"worker{(rank + 1) % world_size}", max, args=(rank, 7))
        rpc.shutdown()
        print("OK", out, flush=True)
    except Exception as e:  # noqa: BLE001  the test reads the error
        print("ERR", f"{type(e).__name__}: {e}".replace("\n", " ")[:2000], flush=True)


if __name__ == "__main__":
    main()
