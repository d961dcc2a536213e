"""``python -m simulator [--nproc-per-node N] script.py [args...]`` (see :mod:`simulator.cli`).

With ``--nproc-per-node N`` the script runs torchrun-style on N ranks; without it, once, as a launcher whose
``torch.multiprocessing.spawn`` / ``multiprocessing.Process`` children are the simulated ranks.
"""
import sys

from simulator.cli import main

sys.exit(main())
