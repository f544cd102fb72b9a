"""Data the seed tests share, importable by their spawned workers (a module named conftest is not:
the workers find tests/conftest.py first on sys.path)."""

import os

WORDS = (
    "the cat sat on the mat and the dog ran to the park while a bird sang in the tall green tree "
    "near the river where children played with a red ball until the sun went down"
).split()


def write_wikitext(folder: str, n_words: int = 400) -> str:
    """A tiny stand-in for WikiText-2's train.txt (Lightning's demo downloads it; shardwise never downloads)."""
    os.makedirs(folder, exist_ok=True)
    lines = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(20)) for i in range(n_words // 20)]
    with open(os.path.join(folder, "train.txt"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return folder
