"""``python -m srm_max.train`` (and ``torchrun -m srm_max.train``): the trainer's CLI."""

from .cli import main

raise SystemExit(main())
