"""``python -m ppolm`` (and ``torchrun --nproc-per-node N -m ppolm ...``): the ``ppolm`` command."""

import sys

from ppolm.cli import main

sys.exit(main())
