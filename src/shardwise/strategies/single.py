"""One process, one device: the reference every other strategy must match.

Everything it does is the base contract's default (autocast precision, a
grad scaler for fp16, plain clipping); it exists as its own name so that
`strategy="single"` reads like the other choices.
"""

from shardwise.strategies.base import Strategy


class SingleDeviceStrategy(Strategy):
    name = "single"
