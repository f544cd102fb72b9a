"""Recipes: complete jobs built on the Trainer.

`shardwise.recipes.finetune` fine-tunes local Hugging Face causal LMs
(`shardwise finetune`, or `FinetuneConfig` + `finetune()` from Python);
`data` and `hf_model` are its data pipeline and its rank-0 loading / export.
Nothing is re-exported here, so `import shardwise` never pulls in
transformers, and the `finetune` module is not shadowed by its function.
"""
