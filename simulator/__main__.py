"""``python -m simulator [--nproc-per-node N] script.py [args...]`` (see :mod:`simulator.cli`).

With ``--nproc-per-node N`` the script runs torchrun-style on N ranks; without it, once, as a launcher whose
``torch.multiprocessing.spawn`` / ``multiprocessing.Process`` children are the simulated ranks.
"""
import sys

from simulator.core.hash_seeds import reexec_with_seeded_hash
from simulator.isolation.warm import prestart_for_command_line

reexec_with_seeded_hash()  # before torch is imported: a string-hash order that follows --seed (see the module)
prestart_for_command_line(sys.argv[1:])  # rank processes' interpreters import torch while this one does

from simulator.cli import main  # noqa: E402

sys.exit(main())
