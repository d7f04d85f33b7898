"""The training programs the tests start as processes of their own: one file per framework
(``train_lightning.py``, ``train_accelerate.py``, ``train_hf_trainer.py``) on the toy model and data of
``toy.py``, each run as ``python PROGRAM MODE ROOT [NAME=VALUE...]`` (``control.py`` says what they mean); and
the memory tier's programs, as texts a test writes and launches under torchrun (``tier.py``).
"""
from pathlib import Path

HERE = Path(__file__).resolve().parent


def path(framework: str) -> Path:
    """The program of ``framework`` ("lightning", "accelerate" or "hf_trainer")."""
    return HERE / f"train_{framework}.py"
