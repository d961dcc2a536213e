"""Where every rank's torch RNG starts: the one seeded authority for a run's randomness.

A program that seeded torch before the run starts every rank from that state (every real process would
have run that seeding); otherwise each rank gets a distinct 64-bit seed that is a pure function of the
run's seed and its rank, as a fresh process gets a random one.  Thread ranks and process-isolated ranks
both start from :func:`initial_rng_states`.
"""
from __future__ import annotations

import hashlib

import torch

__all__ = ["rank_seed", "numpy_seed", "initial_rng_states"]

#: torch's seed when the simulator was imported: a fresh process draws a random 64-bit one
_BOOT_SEED = torch.initial_seed()


def _program_seeded() -> bool:
    """Did the program seed torch in this process before the run (e.g. a module-level ``torch.manual_seed``)?

    Every real process would have run that seeding, so every rank starts from
    the same state.  torch 2.13 gives a fresh process a random 64-bit seed; a
    seed set since import, or a small one (what programs pass), is the program's.
    """
    s = torch.initial_seed()
    return s != _BOOT_SEED or s < 2**32


def rank_seed(run_seed: int, rank: int, salt: int = 0) -> int:
    """The torch seed a rank of an unseeded program starts from: distinct per rank, a pure function of the run's seed
    (and of ``salt``: the second world a launcher starts draws other seeds, as new processes would)."""
    tail = f":{salt}" if salt else ""
    digest = hashlib.blake2b(f"tensorplay-simulator:{run_seed}:{rank}{tail}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") | (1 << 63)  # 64-bit, like the random seed of a fresh process


def numpy_seed(run_seed: int, rank: int) -> int:
    """Where a rank's numpy global generator (``np.random.rand`` & co.) starts: distinct per rank, a pure function
    of the run's seed, on thread ranks and in rank processes alike."""
    return rank_seed(run_seed, rank) & 0xFFFFFFFF


def _initial_rng_states(run_seed: int, n: int, origin: tuple | None = None) -> tuple[list[torch.Tensor], list[int]]:
    """Each rank's starting torch RNG state and seed (see :func:`_program_seeded` and :func:`rank_seed`).

    ``origin`` (processes a launcher started, see :mod:`simulator.launch_seeds`): ``("state", state, seed)``,
    every rank starts there; ``("fresh", salt)``, each rank from a seed of its own; None: as decided here."""
    if origin is not None and origin[0] == "state":
        return [origin[1]] * n, [origin[2]] * n
    if origin is None and _program_seeded():
        state = torch.get_rng_state()
        return [state] * n, [torch.initial_seed()] * n
    salt = origin[1] if origin is not None else 0
    seeds = [rank_seed(run_seed, r, salt) for r in range(n)]
    g = torch.Generator()
    states = []
    for s in seeds:
        g.manual_seed(s)
        states.append(g.get_state())
    return states, seeds


initial_rng_states = _initial_rng_states
