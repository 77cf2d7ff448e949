"""Benchmarks, each a module run from the repository root: ``python -m bench.<name>``
(``pixi run`` names them); results land in ``bench/results/``."""
