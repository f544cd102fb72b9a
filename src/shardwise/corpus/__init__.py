"""Corpora for pre-training: tokenised once into memory-mapped shards, mixed by weight, packed, and read in
one global order that any number of data-parallel ranks resumes exactly.

`prepare` (prepare.py, also `shardwise prepare`) tokenises inputs with all cores into token shards;
`TokenCorpus` (shards.py) reads one through memory maps; `PackedMixture` (mixture.py) is the training
dataset: weighted, packed to a fixed length with document boundaries kept, its position one global
sample count saved in every checkpoint.
"""

from shardwise.corpus.mixture import PackedMixture
from shardwise.corpus.prepare import prepare
from shardwise.corpus.shards import TokenCorpus

__all__ = ["PackedMixture", "TokenCorpus", "prepare"]
