"""The documented path of the LoRA export: `shardwise.adapters.export.export_adapter` / `export_merged`.

The code is recipes/lora_export.py: it writes through the recipe's Hugging Face export
(recipes/hf_model.py), which this layer must not import. This module only names it again, so the
path docs/adapters.md gave keeps working; nothing in shardwise imports it (.ci/structure.py checks
that, and that it holds nothing but this re-export).
"""

from shardwise.recipes.lora_export import (  # noqa: F401 (re-exported)
    ADAPTER_FILES,
    MERGED_DIR,
    check_merge,
    dequantize_weight,
    export_adapter,
    export_lora,
    export_merged,
    find_peft_model,
    lora_matrix_count,
    merged_items,
    plain_config,
)
