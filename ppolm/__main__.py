"""``python -m ppolm`` (and ``torchrun --nproc-per-node N -m ppolm ...``): the ``ppolm`` command."""

import sys

from ppolm.cli import main

if __name__ == "__main__":  # (a process spawned by this one imports this module again)
    sys.exit(main())
