# End to end: a tiny Llama (random weights, saved by the test) and a locally
# built tokenizer are fine-tuned on chat data with FSDP on 2 processes, both
# named by hub id from a hub cache laid out as a download leaves it, with
# HF_HUB_OFFLINE=1; the loss falls, the exported Hugging Face folder loads with from_pretrained,
# holds exactly the trained weights, and generates. In the same 2 processes, after the run, rank-0
# loading into a replicated (NO_SHARD) mesh computes what from_pretrained's model does. Also, in one process:
# rank-0 loading reproduces from_pretrained's model bit for bit (tied
# embeddings, activation-checkpoint wrappers), and a sharded export with an
# index round-trips.
from __future__ import annotations

import functools
import json
import os

import pytest
import torch

from shardwise.recipes.data import DataOptions
from shardwise.recipes.finetune import FinetuneConfig, finetune

from helpers.hf import build_model_folder, chat_records, gather_trained_weights, write_jsonl
from helpers.hub_server import folder_files, lay_cache


def _trained_weights_then_replicated_load(model_dir, module):
    """after_fit (every rank): the trained weights (rank 0), then the untrained model folder loaded from rank 0
    into a NO_SHARD mesh in the same process group; rank 0 gets every rank's (loss, load report)."""
    import torch.distributed as dist

    trained = gather_trained_weights(module)
    scores = [None] * dist.get_world_size()
    dist.all_gather_object(scores, _load_and_score(model_dir, "NO_SHARD", 1))
    return {"trained": trained, "replicated": scores}


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """The 2-process FSDP fine-tuning run (model and data named by hub id), and in its processes, after it,
    the rank-0 load into a replicated mesh (one launch for both: start-up costs more than the load)."""
    from huggingface_hub import constants

    tmp_path = tmp_path_factory.mktemp("e2e")
    records = chat_records(240)
    model_dir = build_model_folder(str(tmp_path / "tiny-llama"), records)
    data = write_jsonl(str(tmp_path / "chat.jsonl"), records)
    out = str(tmp_path / "out")
    cache = str(tmp_path / "hub")
    lay_cache(cache, "org/tiny", folder_files(model_dir))
    lay_cache(cache, "org/chat", {"train.jsonl": open(data, "rb").read()}, repo_type="dataset")
    cfg = FinetuneConfig(
        model_path="org/tiny",
        max_steps=30,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_ratio=0.1,
        weight_decay=0.01,
        logging_steps=10,
        eval_steps=10,
        precision="32-true",
        gradient_checkpointing=True,
        devices=2,
        strategy="fsdp",
        output_dir=out,
        seed=7,
        data=DataOptions(
            dataset="org/chat", max_seq_len=64, packing=True, per_device_train_batch_size=2, eval_split_ratio=0.1
        ),
    )
    with pytest.MonkeyPatch.context() as monkeypatch:
        for name, value in (("HF_HUB_CACHE", cache), ("HF_HUB_OFFLINE", True)):
            monkeypatch.setattr(constants, name, value)
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        result = finetune(cfg, after_fit=functools.partial(_trained_weights_then_replicated_load, model_dir))
    return result, model_dir, out


@pytest.mark.slow
def test_finetune_fsdp_two_processes_exports_a_loadable_model(fsdp_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result, model_dir, out = fsdp_run
    losses = [s["loss"] for s in result.losses]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:3]) / 3, losses
    assert result.eval_losses and result.eval_losses[-1]["eval_loss"] < result.eval_losses[0]["eval_loss"]
    assert result.load["tensors"] > 0 and result.load["bytes_read"] > 0  # rank 0 read the file
    history = json.load(open(os.path.join(out, "finetune_history.json")))
    assert [s["loss"] for s in history["losses"]] == losses

    trained = result.extra["trained"]
    exported = AutoModelForCausalLM.from_pretrained(out)
    state = exported.state_dict()
    assert set(trained) <= set(state)
    for name, value in trained.items():
        assert torch.equal(state[name], value), name
    original = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert not torch.equal(original["model.layers.0.mlp.up_proj.weight"], state["model.layers.0.mlp.up_proj.weight"])

    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = (
        "<|system|> you are a helpful assistant <|endoftext|> <|prompter|> what colour is the sky ? "
        "<|endoftext|> <|assistant|>"
    )
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    generated = exported.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert ids.shape[1] < generated.shape[1] <= ids.shape[1] + 6
    assert "sky" in tokenizer.decode(generated[0, ids.shape[1] :])  # it learned the answer's shape


def _one_process_load(model_dir, export_dir):
    from shardwise import FSDPStrategy
    from shardwise.recipes import hf_model
    from shardwise.recipes.finetune import build_module

    strategy = FSDPStrategy(
        auto_wrap_policy=["LlamaDecoderLayer"], activation_checkpointing_policy=["LlamaDecoderLayer"]
    )
    strategy.connect("cpu", "32-true")
    strategy.setup_environment()
    try:
        folder = hf_model.inspect_model_folder(model_dir)
        module = build_module(FinetuneConfig(model_path=model_dir, data=DataOptions(dataset="-")), folder, 1)
        with strategy.module_init_context():
            module.configure_model()
        module = strategy.setup_module(module)  # the uninitialised-tensor check runs here
        hf_model.export_hf_folder(
            module.model, export_dir, config=folder.config, source_dir=model_dir, max_shard_size=20_000
        )
    finally:
        strategy.teardown()  # leave no process group behind for the next test
    return module


def test_rank0_load_matches_from_pretrained_and_sharded_export_round_trips(tmp_path):
    from transformers import AutoModelForCausalLM

    from shardwise.checkpoint.hf_shards import SAFE_INDEX, weight_files

    model_dir = build_model_folder(str(tmp_path / "tied"), chat_records(20), tie=True)
    export_dir = str(tmp_path / "export")
    _one_process_load(model_dir, export_dir)
    files = weight_files(export_dir)
    assert len(files) > 1 and os.path.exists(os.path.join(export_dir, SAFE_INDEX))  # small shards -> index
    assert os.path.exists(os.path.join(export_dir, "tokenizer.json"))
    reference = AutoModelForCausalLM.from_pretrained(model_dir)
    again = AutoModelForCausalLM.from_pretrained(export_dir)
    assert again.lm_head.weight.data_ptr() == again.model.embed_tokens.weight.data_ptr()  # still tied
    ref_state, state = reference.state_dict(), again.state_dict()
    for name in ref_state:
        assert torch.equal(ref_state[name], state[name]), name
    ids = torch.tensor([[1, 5, 9, 12, 3, 7]])
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, reference(ids).logits)


@pytest.mark.slow
def test_save_steps_checkpoints_resume_exactly(tmp_path):
    # Sharded intermediate checkpoints come from the checkpoint layer
    # (ModelCheckpoint(every_n_train_steps=save_steps)); resuming with
    # resume_from_checkpoint="last" continues the same loss curve.
    records = chat_records(120)
    model_dir = build_model_folder(str(tmp_path / "m"), records)
    data = write_jsonl(str(tmp_path / "chat.jsonl"), records)
    common = dict(
        model_path=model_dir,
        dataset=data,
        max_seq_len=64,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        precision="32-true",
        eval_split_ratio=0.0,
        devices=1,
        save_steps=3,
        logging_steps=100,
        cache_dir=str(tmp_path / "cache"),
    )
    straight = finetune(dict(max_steps=6, output_dir=str(tmp_path / "a"), **common))
    finetune(dict(max_steps=3, output_dir=str(tmp_path / "b"), **common))
    assert os.path.exists(tmp_path / "b" / "checkpoints" / "last.ckpt")
    resumed = finetune(dict(max_steps=6, output_dir=str(tmp_path / "b"), resume_from_checkpoint="last", **common))
    # The history keeps the steps before the resume (they travel in the checkpoint), each once.
    assert [s["step"] for s in resumed.losses] == [1, 2, 3, 4, 5, 6]
    assert [s["loss"] for s in resumed.losses] == pytest.approx([s["loss"] for s in straight.losses], rel=1e-6)


def _load_and_score(model_dir, sharding, num_nodes):
    from shardwise import FSDPStrategy
    from shardwise.recipes import hf_model
    from shardwise.recipes.finetune import build_module

    strategy = FSDPStrategy(auto_wrap_policy=["LlamaDecoderLayer"], sharding_strategy=sharding)
    strategy.connect("cpu", "32-true", num_nodes=num_nodes)
    strategy.setup_environment()
    folder = hf_model.inspect_model_folder(model_dir)
    module = build_module(FinetuneConfig(model_path=model_dir, data=DataOptions(dataset="-")), folder, 1)
    with strategy.module_init_context():
        module.configure_model()
    module = strategy.setup_module(module)
    ids = torch.tensor([[1, 5, 9, 12, 3, 7]])
    with torch.no_grad():
        loss = strategy.call(module, "_loss", {"input_ids": ids, "labels": ids}).detach()
    return loss, dict(module.load_report.__dict__)


@pytest.mark.slow
def test_rank0_loading_into_a_replicated_mesh(fsdp_run):
    # Rank 0 sends to the first replica only; the others get their shards by
    # broadcast inside their replicate group. The loaded model must compute
    # exactly what from_pretrained's does, on every rank. (NO_SHARD is the
    # (2 replicas x 1 shard) mesh; HYBRID_SHARD is covered across two
    # launchers by tests/distributed/test_multinode_finetune.py.) Loaded in the
    # fine-tuning run's 2 processes, after it (fsdp_run).
    from transformers import AutoModelForCausalLM

    result, model_dir, _ = fsdp_run
    ids = torch.tensor([[1, 5, 9, 12, 3, 7]])
    expected = AutoModelForCausalLM.from_pretrained(model_dir)(input_ids=ids, labels=ids).loss.detach()
    results = result.extra["replicated"]
    assert len(results) == 2
    for loss, report in results:
        torch.testing.assert_close(loss, expected)
    assert results[0][1]["bytes_read"] > 0 and all(r["bytes_read"] == 0 for _, r in results[1:])


@pytest.mark.slow
def test_unpacked_padded_batches_train_and_export_bf16(tmp_path):
    # packing=False: one padded record per example (attention_mask + -100 labels
    # on padding), gradient accumulation, and an export in another dtype.
    from transformers import AutoConfig

    records = chat_records(60)
    model_dir = build_model_folder(str(tmp_path / "m"), records)
    cfg = FinetuneConfig(
        model_path=model_dir,
        max_steps=6,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        precision="32-true",
        devices=1,
        export_dtype="bfloat16",
        output_dir=str(tmp_path / "out"),
        data=DataOptions(
            dataset=write_jsonl(str(tmp_path / "c.jsonl"), records),
            packing=False,
            max_seq_len=48,
            per_device_train_batch_size=4,
            eval_split_ratio=0.0,
        ),
    )
    result = finetune(cfg)
    losses = [s["loss"] for s in result.losses]
    assert len(losses) == 6 and losses[-1] < losses[0]
    exported = AutoConfig.from_pretrained(str(tmp_path / "out"))
    assert exported.dtype == torch.bfloat16 and exported.use_cache is True


def test_rope_buffers_are_recomputed_not_silenced(tmp_path, monkeypatch):
    # No checkpoint holds RoPE's inv_freq; without the recomputation the
    # strategy's uninitialised-tensor check must name it.
    from shardwise.recipes import hf_model
    from shardwise.strategies.materialize import UninitializedParameterError

    model_dir = build_model_folder(str(tmp_path / "m"), chat_records(10))
    monkeypatch.setattr(hf_model, "recompute_buffers", lambda model: [])
    with pytest.raises(UninitializedParameterError, match="rotary_emb.inv_freq"):
        _one_process_load(model_dir, str(tmp_path / "never"))
