"""``python -m bitmosaic`` = the ``bitmosaic`` command (also what ``torchrun -m bitmosaic`` runs)."""

import sys

from .cli import main

sys.exit(main())
