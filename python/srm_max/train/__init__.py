"""Training: the loop, its data, optimizer, checkpoints and CLI, for the PyTorch reference models.

    from srm_max.train import TrainConfig, train   # train any next-token model in place
    srm-max train --out runs/srm --tokenizer tokenizer.json ...   # or python -m srm_max.train

- ``loop``: ``train`` and ``evaluate``
- ``data``: token streams and the batches a step draws; ``corpus``: the default training text
- ``optim``: AdamW, the learning-rate schedule, precision
- ``checkpoints``: the checkpoints ``--resume`` continues from
- ``models``: the architectures ``--arch`` picks
- ``tokenizer``: the default model's byte-level BPE
- ``run_dir``: the output directory, and when a run may write there
- ``errors``: ``TrainError``, the trainer's refusal of a bad argument, file or directory
- ``cli``: the command line
"""

from .cli import main, parse_args
from .config import TrainConfig
from .data import eval_windows, load_data, sample_batch, tokenize_documents
from .errors import TrainError
from .loop import evaluate, train
from .optim import lr_at

__all__ = ["TrainConfig", "TrainError", "train", "evaluate", "main", "parse_args", "lr_at", "sample_batch",
           "eval_windows", "load_data", "tokenize_documents"]
