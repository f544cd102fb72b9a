# The seed demo model: an encoder/decoder Transformer language model with the
# same constructor and call shape as PyTorch Lightning's demo Transformer
# (`out = model(input, target); loss = F.nll_loss(out, target.view(-1))`), so
# the seed examples (1B = 32 layers, 2B = 64 layers at width 1024) run
# unchanged. It is built from PyTorch's own `nn.TransformerEncoderLayer` /
# `nn.TransformerDecoderLayer`, so a wrap policy naming those two classes
# matches it. It is written to survive meta-device construction: every
# parameter and buffer is (re)initialised by some module's `reset_parameters()`
# (or `nn.MultiheadAttention._reset_parameters()`), and nothing depends on
# values computed only in `__init__`.
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["PositionalEncoding", "Transformer", "TRANSFORMER_SIZES", "transformer_num_params"]

# The seed example sizes. Only depth differs between them; vocab comes from the data.
TRANSFORMER_SIZES: dict[str, dict[str, int]] = {
    "1b": {"nlayers": 32, "nhid": 4096, "ninp": 1024, "nhead": 64},
    "2b": {"nlayers": 64, "nhid": 4096, "ninp": 1024, "nhead": 64},
}


class PositionalEncoding(nn.Module):
    """Adds the fixed sinusoidal position table of "Attention Is All You Need".

    The table is a non-persistent buffer: it is derived data, so checkpoints do
    not carry it, and `reset_parameters()` rebuilds it after a meta-device model
    is materialised with `to_empty()` (which leaves buffers uninitialised).
    """

    def __init__(self, d_model: int, max_len: int = 4096, dropout: float = 0.0) -> None:
        super().__init__()
        self.d_model = d_model
        self.max_len = max_len
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("pe", torch.empty(max_len, d_model), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Build on the buffer's own device so this is free on meta and correct
        # after `to_empty(device=...)`; compute in float32 for accuracy, then
        # store in whatever dtype the model was cast to.
        device = self.pe.device
        position = torch.arange(self.max_len, device=device, dtype=torch.float32).unsqueeze(1)
        freq = torch.exp(
            torch.arange(0, self.d_model, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / self.d_model)
        )
        table = torch.zeros(self.max_len, self.d_model, device=device, dtype=torch.float32)
        table[:, 0::2] = torch.sin(position * freq)
        # For odd widths there is one fewer cosine column than sine columns.
        table[:, 1::2] = torch.cos(position * freq[: self.d_model // 2])
        with torch.no_grad():
            self.pe.copy_(table)

    def forward(self, x: Tensor) -> Tensor:
        seq_len = x.size(1)
        if seq_len > self.max_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds the positional table's max_len={self.max_len}; "
                "construct the model with a larger max_len"
            )
        return self.dropout(x + self.pe[:seq_len].to(x.dtype))


class Transformer(nn.Module):
    """Encoder/decoder language model returning flattened log-probabilities.

    Args:
        vocab_size: number of tokens (33278 is WikiText-2's word vocabulary,
            Lightning's default; pass `dataset.vocab_size`).
        nlayers: number of encoder layers and, separately, of decoder layers.
        nhid: feed-forward width.
        ninp: model (embedding) width.
        nhead: attention heads; must divide `ninp`.
        dropout: 0.0 by default (Lightning uses 0.2). Dropout draws from each
            rank's RNG, so with it on, DDP, FSDP and DeepSpeed runs of the same
            seed produce different losses; at 0.0 they agree exactly, which is
            what the strategy-parity tests and benchmarks rely on.
        max_len: longest sequence the positional table covers.

    Unlike Lightning's demo, the answer does not leak into the prediction.
    Lightning feeds the (shifted) target into the decoder and lets the encoder
    see the whole input, so position i can read token i+1 and the loss falls
    towards zero without learning language. Here the decoder reads the input,
    and encoder self-attention, decoder self-attention and cross-attention are
    all causal, so position i only sees tokens 0..i. The compute per step is
    the same as Lightning's; `target` is accepted for call compatibility and
    only checked for shape.
    """

    def __init__(
        self,
        vocab_size: int = 33278,
        nlayers: int = 16,
        nhid: int = 4096,
        ninp: int = 1024,
        nhead: int = 64,
        dropout: float = 0.0,
        max_len: int = 4096,
    ) -> None:
        super().__init__()
        if ninp % nhead != 0:
            raise ValueError(f"ninp={ninp} must be divisible by nhead={nhead}")
        self.vocab_size = vocab_size
        self.ninp = ninp
        self.embedding = nn.Embedding(vocab_size, ninp)
        self.pos_encoder = PositionalEncoding(ninp, max_len=max_len, dropout=dropout)

        # Independent layers rather than nn.TransformerEncoder(layer, n): that
        # class deep-copies one layer, so every layer would start identical,
        # and nn.Transformer re-initialises in its own __init__ (xavier), which
        # a meta-device build never runs. Here each layer's init is exactly its
        # submodules' reset_parameters, the same on CPU and after to_empty().
        def layer_kwargs() -> dict[str, object]:
            return dict(d_model=ninp, nhead=nhead, dim_feedforward=nhid, dropout=dropout, batch_first=True)

        self.encoder_layers = nn.ModuleList(nn.TransformerEncoderLayer(**layer_kwargs()) for _ in range(nlayers))
        self.decoder_layers = nn.ModuleList(nn.TransformerDecoderLayer(**layer_kwargs()) for _ in range(nlayers))
        # nn.Transformer puts a final LayerNorm after each stack; keep that shape.
        self.encoder_norm = nn.LayerNorm(ninp)
        self.decoder_norm = nn.LayerNorm(ninp)
        self.decoder = nn.Linear(ninp, vocab_size)

    def forward(self, inputs: Tensor, target: Tensor | None = None) -> Tensor:
        if target is not None and target.shape != inputs.shape:
            raise ValueError(f"target shape {tuple(target.shape)} must match inputs shape {tuple(inputs.shape)}")
        seq_len = inputs.size(1)
        # A boolean mask (True = may not attend) is converted by PyTorch to the
        # query's dtype, so it works under autocast and bf16 parameters alike;
        # the is_causal hints let attention use its fused causal kernel.
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=inputs.device).triu(1)

        # No sqrt(ninp) scaling of the embedding: nn.Embedding's default init is
        # already N(0, 1), and scaling by sqrt(1024) = 32 would drown the
        # positional signal (amplitude ~1).
        x = self.pos_encoder(self.embedding(inputs))
        memory = x
        for layer in self.encoder_layers:
            memory = layer(memory, src_mask=causal, is_causal=True)
        memory = self.encoder_norm(memory)

        out = x
        for layer in self.decoder_layers:
            out = layer(out, memory, tgt_mask=causal, memory_mask=causal, tgt_is_causal=True, memory_is_causal=True)
        out = self.decoder(self.decoder_norm(out))
        return F.log_softmax(out, dim=-1).view(-1, self.vocab_size)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def transformer_num_params(vocab_size: int, nlayers: int, nhid: int, ninp: int, nhead: int = 1) -> int:
    """Parameter count of `Transformer(...)` without building it (nhead does not change it)."""
    del nhead
    attention = 4 * ninp * ninp + 4 * ninp  # packed q/k/v projection + output projection, with biases
    feed_forward = 2 * ninp * nhid + nhid + ninp
    layer_norm = 2 * ninp
    encoder_layer = attention + feed_forward + 2 * layer_norm
    decoder_layer = 2 * attention + feed_forward + 3 * layer_norm
    embedding = vocab_size * ninp
    output = ninp * vocab_size + vocab_size
    return embedding + nlayers * (encoder_layer + decoder_layer) + 2 * layer_norm + output
