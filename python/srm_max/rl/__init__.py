"""Reinforcement learning on verifiable tasks.

- ``groups``: scoring many samples: pass@k, balanced GRPO groups, group-normalised advantages
- ``grpo``: GRPO on the PyTorch reference SRM, with rollouts from the MAX Generator
- ``arithmetic``: a verifiable task generated in code (multi-digit addition)
- ``worked_arithmetic``: a harder one, two steps with a worked answer ("a+b=c;c-d=e")

``grpo`` needs PyTorch and the MAX engine; ``groups`` and the tasks need neither,
which is why only ``groups`` is imported here.
"""

from .groups import balanced_group, group_advantages, mean_pass_at_k, pass_at_k

__all__ = ["pass_at_k", "mean_pass_at_k", "balanced_group", "group_advantages"]
