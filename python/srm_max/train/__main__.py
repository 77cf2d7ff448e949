"""``python -m srm_max.train`` (and ``torchrun -m srm_max.train``): the trainer's CLI, with the
errors of ``srm-max train`` (one line naming the problem, exit 2)."""

import sys

from ..cli import main

raise SystemExit(main(["train", *sys.argv[1:]]))
