# Lightning's `lightning.pytorch.demos.transformer` names and shardwise's text demos. `Transformer`,
# `WikiText2` and `LightningTransformer` are Lightning's: the same model, defaults and numbers, so a
# Lightning script importing them runs unchanged after the import rename. The word-level text datasets
# cut non-overlapping blocks of `block_size` token ids (target = input shifted by one). Nothing here
# downloads: `WikiText2` reads a file the user already has and names it when it is missing, and
# `PythonDocsText` builds its corpus from the help texts that ship inside every CPython installation
# (`pydoc_data.topics`), so demos and tests run offline and start in well under a second.
# `LanguageModel` (the `shardwise demo` module) trains shardwise's own demo model,
# `shardwise.models.Transformer` (causal attention, built on the meta device).
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from shardwise.models.lightning_transformer import PositionalEncoding, Transformer
from shardwise.models.transformer import Transformer as CausalTransformer
from shardwise.module import TrainModule

__all__ = [
    "PositionalEncoding",
    "Transformer",
    "LightningTransformer",
    "LanguageModel",
    "Dictionary",
    "TokenBlocks",
    "WikiText2",
    "PythonDocsText",
    "load_text_dataset",
]

Split = Literal["train", "val"]


class Dictionary:
    """Word <-> id mapping; ids are assigned in order of first appearance."""

    def __init__(self) -> None:
        self.word2idx: dict[str, int] = {}
        self.idx2word: list[str] = []

    def add_word(self, word: str) -> int:
        if word not in self.word2idx:
            self.word2idx[word] = len(self.idx2word)
            self.idx2word.append(word)
        return self.word2idx[word]

    def __len__(self) -> int:
        return len(self.idx2word)


def _words(lines: Iterable[str], skip_blank: bool) -> list[str]:
    # Whitespace split plus an end-of-line marker, as in Lightning's demo and
    # PyTorch's word_language_model example.
    words: list[str] = []
    for line in lines:
        parts = line.split()
        if skip_blank and not parts:
            continue
        words.extend(parts)
        words.append("<eos>")
    return words


class TokenBlocks(Dataset[tuple[Tensor, Tensor]]):
    """Non-overlapping (input, target) blocks cut from one long token stream.

    Item i is `data[i*B : i*B + B]` and the same window shifted by one, both
    LongTensors of length `block_size`. The last partial block is dropped so
    every item has the same shape.
    """

    def __init__(self, data: Tensor, dictionary: Dictionary, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if data.numel() < block_size + 1:
            raise ValueError(f"{data.numel()} tokens are too few for one block of {block_size} (+1 for the target)")
        self.data = data
        self.dictionary = dictionary
        self.block_size = block_size

    @property
    def vocab_size(self) -> int:
        return len(self.dictionary)

    def __len__(self) -> int:
        # The target of the last block needs one token past it.
        return (self.data.numel() - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} blocks")
        start = (index % len(self)) * self.block_size
        end = start + self.block_size
        return self.data[start:end], self.data[start + 1 : end + 1]


class WikiText2(TokenBlocks):
    """WikiText-2 from a local folder, tokenised by whitespace, as Lightning's demo dataset.

    `WikiText2()` takes Lightning's arguments and defaults (`data_dir="./data"`, `block_size=35`,
    `download=True`) and its length (`len(data) // block_size - 1` blocks), but never downloads:
    `data_dir` must contain the raw files: `wikitext-2.txt` (the file Lightning downloads),
    `wiki.train.tokens` / `wiki.valid.tokens` (the official release) or `train.txt` / `valid.txt`
    (PyTorch examples' copy). The dictionary is always built from the train split so ids agree
    across splits; a validation word missing from it maps to `<unk>`. Blank lines keep their
    `<eos>`, matching Lightning's tokenisation (whose default vocab_size, 33,278, is this count for
    the standard files).
    """

    _FILES: dict[str, tuple[str, ...]] = {
        "train": ("wikitext-2.txt", "wiki.train.tokens", "train.txt"),
        "val": ("wiki.valid.tokens", "valid.txt"),
    }
    URL = "https://raw.githubusercontent.com/pytorch/examples/main/word_language_model/data/wikitext-2/train.txt"

    def __init__(
        self, data_dir: str | Path = "./data", block_size: int = 35, download: bool = True, split: Split = "train"
    ) -> None:
        del download  # Lightning's flag: shardwise reads what is there, and says what is missing
        root = Path(data_dir).expanduser()
        if not root.is_dir():
            raise FileNotFoundError(
                f"WikiText-2 folder {str(root)!r} does not exist. shardwise never downloads data; "
                f"put wikitext-2.txt there (the file Lightning downloads: {self.URL}), or "
                "wiki.train.tokens / train.txt, or use PythonDocsText(), which needs no files."
            )
        if split not in self._FILES:
            raise ValueError(f"split must be one of {sorted(self._FILES)}, got {split!r}")
        train_words = _words(self._read(root, "train"), skip_blank=False)
        dictionary = Dictionary()
        ids = [dictionary.add_word(w) for w in train_words]
        # Added for every split (WikiText already contains it) so vocab_size
        # is the same whichever split built the model.
        unk = dictionary.add_word("<unk>")
        if split != "train":
            ids = [dictionary.word2idx.get(w, unk) for w in _words(self._read(root, split), skip_blank=False)]
        super().__init__(torch.tensor(ids, dtype=torch.long), dictionary, block_size)

    def __len__(self) -> int:
        # Lightning's count, one block fewer than fit when the stream divides unevenly: the same batches.
        return max(self.data.numel() // self.block_size - 1, 0)

    @classmethod
    def _read(cls, root: Path, split: str) -> list[str]:
        for name in cls._FILES[split]:
            path = root / name
            if path.is_file():
                return path.read_text(encoding="utf-8").splitlines()
        raise FileNotFoundError(
            f"no {split} file in {str(root)!r}; looked for {', '.join(cls._FILES[split])}. shardwise never "
            f"downloads: put one there (Lightning's demo downloads {cls.URL} as wikitext-2.txt)."
        )


class PythonDocsText(TokenBlocks):
    """A small offline corpus: the help topics bundled with CPython.

    Text is `pydoc_data.topics.topics` (what `help("for")` prints), topics in
    sorted key order so the token stream is identical on every run and rank.
    Blank lines are skipped (the help texts have many, and runs of `<eos>`
    would only teach the model to emit `<eos>`). On Python 3.11.7 this gives
    74,217 tokens and a vocabulary of 8,832 words (train: 66,795 tokens =
    1,043 blocks of 64; val: 7,422 tokens = 115 blocks), built in ~25 ms;
    other Python versions ship slightly different texts, so the numbers move a
    little between interpreters but are fixed for one installation.

    Splits: the vocabulary covers the whole corpus (ids agree across splits);
    "train" is the first 90% of the token stream and "val" the last 10%.
    """

    def __init__(self, block_size: int = 64, split: Split = "train") -> None:
        from pydoc_data.topics import topics

        dictionary = Dictionary()
        ids = [dictionary.add_word(w) for w in _words(_topic_lines(topics), skip_blank=True)]
        data = torch.tensor(ids, dtype=torch.long)
        cut = int(0.9 * data.numel())
        if split == "train":
            data = data[:cut]
        elif split == "val":
            data = data[cut:]
        else:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        super().__init__(data, dictionary, block_size)


def _topic_lines(topics: dict[str, str]) -> Iterable[str]:
    for key in sorted(topics):
        yield from topics[key].splitlines()


def load_text_dataset(data_dir: str | Path | None = None, block_size: int = 64, split: Split = "train") -> TokenBlocks:
    """WikiText-2 from `data_dir` if one is given, otherwise the offline `PythonDocsText`.

    A given but missing folder is an error rather than a silent fallback, so a
    typo in a path cannot quietly swap the training data.
    """
    if data_dir is not None:
        return WikiText2(data_dir, block_size=block_size, split=split)
    return PythonDocsText(block_size=block_size, split=split)


class LanguageModel(TrainModule):
    """The seed's LightningModule for the demo Transformer, as a TrainModule.

    The model, shardwise's causal `shardwise.models.Transformer`, is built in
    `configure_model`, so under FSDP it is created on the meta device and
    sharded before any weight exists. Used by `shardwise demo`, the
    benchmarks and the tests; the examples spell the same class out, since it
    is the code a user writes.
    """

    def __init__(
        self,
        vocab_size: int,
        nlayers: int = 2,
        nhid: int = 256,
        ninp: int = 64,
        nhead: int = 4,
        lr: float = 1e-3,
        foreach: bool | None = None,
    ) -> None:
        super().__init__()
        self.vocab_size, self.lr, self.foreach = vocab_size, lr, foreach
        self.sizes = dict(nlayers=nlayers, nhid=nhid, ninp=ninp, nhead=nhead)
        self.model: CausalTransformer | None = None

    def configure_model(self) -> None:
        if self.model is None:  # idempotent
            self.model = CausalTransformer(vocab_size=self.vocab_size, **self.sizes)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        input, target = batch
        return F.nll_loss(self.model(input, target), target.view(-1))

    def training_step(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr, foreach=self.foreach)


class LightningTransformer(TrainModule):
    """Lightning's `LightningTransformer` demo module: the demo Transformer on WikiText2, SGD at lr 0.1."""

    def __init__(self, vocab_size: int = 33278) -> None:
        super().__init__()
        self.model = Transformer(vocab_size=vocab_size)

    def forward(self, inputs: Tensor, target: Tensor) -> Tensor:
        return self.model(inputs, target)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, target = batch
        output = self(inputs, target)
        return F.nll_loss(output, target.view(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=0.1)

    def prepare_data(self) -> None:
        WikiText2(download=True)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(WikiText2())
