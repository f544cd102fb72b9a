"""Lightning's demo Transformer (`lightning.pytorch.demos.Transformer`, Lightning 2.6), as it is.

`shardwise.demos.Transformer` is this class, so a Lightning script that imports the demo model gets the
same model -- its defaults (a 1.3M-parameter model: vocab 33278, width 200, 2 heads, feed-forward 200,
2 encoder and 2 decoder layers, dropout 0.2), its parameter names, its initialisation (nn.Transformer's
xavier init) and its forward -- and so Lightning's numbers. Adapted from Lightning's
`lightning/pytorch/demos/transformer.py` (Apache License 2.0), itself from PyTorch's
word_language_model example; the code below keeps its arithmetic, quirks included: the target is fed
to the decoder, the encoder sees the whole input, and each position adds the encoding of position
`seq_len` (not its own). shardwise's own demo model, with causal attention and a meta-device-safe
init, is `shardwise.models.Transformer`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Transformer", "PositionalEncoding"]


class Transformer(nn.Module):
    """`lightning.pytorch.demos.Transformer`: `log_probs = model(inputs, target)`, shape (batch * seq, vocab)."""

    def __init__(
        self,
        vocab_size: int = 33278,  # WikiText-2's word vocabulary
        ninp: int = 200,
        nhead: int = 2,
        nhid: int = 200,
        nlayers: int = 2,
        dropout: float = 0.2,
    ) -> None:
        super().__init__()
        self.pos_encoder = PositionalEncoding(ninp, dropout)
        self.embedding = nn.Embedding(vocab_size, ninp)
        self.transformer = nn.Transformer(
            d_model=ninp,
            nhead=nhead,
            num_encoder_layers=nlayers,
            num_decoder_layers=nlayers,
            dim_feedforward=nhid,
            dropout=dropout,
            batch_first=True,
        )
        self.decoder = nn.Linear(ninp, vocab_size)
        self.ninp = ninp
        self.vocab_size = vocab_size
        self.src_mask: Optional[Tensor] = None

    def generate_square_subsequent_mask(self, size: int) -> Tensor:
        """The additive causal mask: -inf above the diagonal, 0 elsewhere."""
        mask = torch.triu(torch.ones(size, size), diagonal=1)
        return mask.float().masked_fill(mask == 1, float("-inf")).masked_fill(mask == 0, 0.0)

    def forward(self, inputs: Tensor, target: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        _, t = inputs.shape
        # Lightning builds (and keeps) a source mask it never passes on; kept for the same attributes.
        if self.src_mask is None or self.src_mask.size(0) != t:
            self.src_mask = self.generate_square_subsequent_mask(t).to(inputs.device)
        if mask is None:
            mask = self.generate_square_subsequent_mask(t).to(inputs.device)
        src = self.pos_encoder(self.embedding(inputs) * math.sqrt(self.ninp))
        target = self.pos_encoder(self.embedding(target) * math.sqrt(self.ninp))
        output = self.transformer(src, target, tgt_mask=mask)
        output = self.decoder(output)
        output = F.log_softmax(output, dim=-1)
        return output.view(-1, self.vocab_size)


class PositionalEncoding(nn.Module):
    """Lightning's demo positional encoding: a sinusoid table built on the input's device at the first forward.

    The table is a plain attribute, neither a buffer nor a parameter (Lightning's choice: a buffer would
    be sliced, and DDP requires every parameter to take part in the forward), so checkpoints do not hold it.
    """

    def __init__(self, dim: int, dropout: float = 0.1, max_len: int = 5000) -> None:
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        self.dim = dim
        self.max_len = max_len
        self.pe: Optional[Tensor] = None

    def forward(self, x: Tensor) -> Tensor:
        if self.pe is None:
            self.pe = self._init_pos_encoding(device=x.device)
        x = x + self.pe[:, x.size(1)]
        return self.dropout(x)

    def _init_pos_encoding(self, device: torch.device) -> Tensor:
        pe = torch.zeros(self.max_len, self.dim, device=device)
        position = torch.arange(0, self.max_len, dtype=torch.float, device=device).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, self.dim, 2, device=device).float() * (-math.log(10000.0) / self.dim))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        return pe.unsqueeze(0)
