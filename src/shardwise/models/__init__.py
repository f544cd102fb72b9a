# Models shipped with shardwise: the seed demo `Transformer` (encoder/decoder,
# Lightning's demo shape) and `GPT` with its `GPTConfig`, `Block` (the unit to
# wrap and checkpoint) and named presets (minGPT seed sizes, Llama 2 / 3, tiny
# test shapes). All of them can be built on the meta device and initialised
# afterwards through per-module `reset_parameters()`.
from shardwise.models.gpt import GPT, PRESETS, Block, GPTConfig, gpt_config
from shardwise.models.transformer import TRANSFORMER_SIZES, Transformer, transformer_num_params

__all__ = [
    "GPT",
    "PRESETS",
    "TRANSFORMER_SIZES",
    "Block",
    "GPTConfig",
    "Transformer",
    "gpt_config",
    "transformer_num_params",
]
