"""``python -m simulator --nproc-per-node N script.py [args...]`` (see :mod:`simulator.cli`)."""
import sys

from .cli import main

sys.exit(main())
