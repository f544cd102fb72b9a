# Unit tests for the shipped models, the chunked loss and the demo datasets.
# The central check is meta-device initialisation: strategies build models on
# the meta device, materialise them with `to_empty()` and then call each
# module's own `reset_parameters()`, so any tensor that only `__init__` fills
# (a positional table, a rotary cache, a tied weight) would silently train as
# garbage. The tests fill everything with NaN first to make such a gap visible.
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise.demos import PythonDocsText, WikiText2, load_text_dataset
from shardwise.losses import chunked_cross_entropy
from shardwise.models import GPT, PRESETS, Block, GPTConfig, Transformer, gpt_config, transformer_num_params


def _init_per_module(model: nn.Module, seed: int) -> None:
    """Initialise the way a strategy does after to_empty(): one seed per module.

    Children go before parents (reverse pre-order) because
    nn.MultiheadAttention._reset_parameters also zeroes its child out_proj's
    bias, and that must not be overwritten by out_proj's own reset afterwards.
    """
    modules = list(model.modules())
    for index in reversed(range(len(modules))):
        module = modules[index]
        torch.manual_seed(seed + index)
        if isinstance(module, nn.MultiheadAttention):
            module._reset_parameters()
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()


def _all_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    # Non-persistent buffers are absent from state_dict(), so list them directly.
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


SMALL_MODELS: dict[str, Callable[[], nn.Module]] = {
    "transformer": lambda: Transformer(vocab_size=97, nlayers=2, nhid=48, ninp=32, nhead=4, max_len=64),
    "gpt-tiny": lambda: GPT(PRESETS["gpt-tiny"]),
    "llama-tiny": lambda: GPT(PRESETS["llama-tiny"]),
}


def _forward(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    return model(idx, idx) if isinstance(model, Transformer) else model(idx)


@pytest.mark.parametrize("name", list(SMALL_MODELS))
def test_meta_init_reinitialises_every_tensor(name: str) -> None:
    build = SMALL_MODELS[name]
    reference = build()
    _init_per_module(reference, seed=1234)

    with torch.device("meta"):
        model = build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in _all_tensors(model).values():
            tensor.fill_(float("nan"))
    _init_per_module(model, seed=1234)

    tensors, expected = _all_tensors(model), _all_tensors(reference)
    assert tensors.keys() == expected.keys()
    for key, tensor in tensors.items():
        assert not torch.isnan(tensor).any(), f"{key} was not re-initialised by any reset_parameters()"
        torch.testing.assert_close(tensor, expected[key], rtol=0, atol=0, msg=f"{key} differs")

    idx = torch.randint(0, 97 if name == "transformer" else 256, (2, 16))
    model.eval(), reference.eval()
    out = _forward(model, idx)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, _forward(reference, idx), rtol=0, atol=0)


def test_computed_buffers_are_not_checkpointed() -> None:
    # Derived tables are rebuilt by reset_parameters(); saving them would only
    # make checkpoints depend on max_len / block_size.
    assert not any("rotary" in k for k in GPT(PRESETS["llama-tiny"]).state_dict())
    assert not any(k.endswith(".pe") for k in SMALL_MODELS["transformer"]().state_dict())


def test_gpt2_init_scales_residual_projections() -> None:
    cfg = gpt_config("gpt-tiny", n_embd=256, n_head=4, n_layer=8)
    block = GPT(cfg).blocks[0]
    assert block.attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.attn.o_proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert block.mlp.down_proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)


@pytest.mark.parametrize("name", list(SMALL_MODELS))
def test_models_are_causal(name: str) -> None:
    torch.manual_seed(0)
    model = SMALL_MODELS[name]().eval()
    idx = torch.randint(0, 90, (1, 12))
    changed = idx.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 90
    out, out_changed = _forward(model, idx), _forward(model, changed)
    out, out_changed = out.view(1, 12, -1), out_changed.view(1, 12, -1)
    torch.testing.assert_close(out[:, :8], out_changed[:, :8])
    assert not torch.allclose(out[:, 8:], out_changed[:, 8:])


def test_transformer_matches_lightning_call_shape() -> None:
    model = SMALL_MODELS["transformer"]()
    inputs = torch.randint(0, 97, (3, 10))
    output = model(inputs, inputs)
    assert output.shape == (30, 97)
    torch.testing.assert_close(output.exp().sum(-1), torch.ones(30))  # log-probabilities
    F.nll_loss(output, inputs.view(-1)).backward()
    with pytest.raises(ValueError, match="target shape"):
        model(inputs, inputs[:, :5])
    wrapped = {type(m) for m in model.modules()}
    assert {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer} <= wrapped


def test_transformer_param_count_formula() -> None:
    model = SMALL_MODELS["transformer"]()
    assert model.num_params() == transformer_num_params(97, nlayers=2, nhid=48, ninp=32)
    assert transformer_num_params(33278, nlayers=32, nhid=4096, ninp=1024) == 1_008_763_390


def test_grouped_query_attention_shapes_and_semantics() -> None:
    cfg = PRESETS["llama-tiny"]
    assert (cfg.n_head, cfg.kv_heads, cfg.head_dim) == (4, 2, 16)
    torch.manual_seed(0)
    gqa = GPT(cfg).eval()
    attn = gqa.blocks[0].attn
    assert attn.q_proj.weight.shape == (64, 64)
    assert attn.k_proj.weight.shape == attn.v_proj.weight.shape == (32, 64)
    assert sum(isinstance(m, Block) for m in gqa.modules()) == cfg.n_layer

    # A GQA model equals full multi-head attention whose k/v heads are the
    # shared heads repeated: query head h reads kv head h // (n_head / n_kv_head).
    full = GPT(gpt_config("llama-tiny", n_kv_head=4)).eval()
    state = gqa.state_dict()
    for key, value in state.items():
        if key.endswith(("k_proj.weight", "v_proj.weight")):
            state[key] = value.view(2, 16, 64).repeat_interleave(2, dim=0).reshape(64, 64)
    full.load_state_dict(state)
    idx = torch.randint(0, 256, (2, 20))
    torch.testing.assert_close(gqa(idx), full(idx))


PUBLISHED = {  # parameter counts of the released checkpoints
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_llama_preset_counts_match_published(name: str) -> None:
    assert PRESETS[name].num_params() == pytest.approx(PUBLISHED[name], rel=0.02)
    assert PRESETS[name].num_params() == PUBLISHED[name]  # the shapes are exact, so is the count


@pytest.mark.parametrize(("name", "billions"), [("mingpt-1.7b", 1.7), ("mingpt-12.8b", 12.8), ("mingpt-45b", 45)])
def test_mingpt_preset_names_are_non_embedding_sizes(name: str, billions: float) -> None:
    assert PRESETS[name].num_params(non_embedding=True) == pytest.approx(billions * 1e9, rel=0.02)


@pytest.mark.parametrize("name", ["llama-3-8b", "mingpt-1.7b", "gpt-tiny", "llama-tiny"])
def test_analytic_count_matches_built_model(name: str) -> None:
    with torch.device("meta"):
        model = GPT(PRESETS[name])
    assert model.num_params() == PRESETS[name].num_params()
    assert model.num_params(non_embedding=True) == PRESETS[name].num_params(non_embedding=True)


def test_gpt_config_lookup() -> None:
    with pytest.raises(ValueError, match="llama-3-8b"):
        gpt_config("llama-4")
    cfg = gpt_config("gpt-tiny", vocab_size=1000)
    assert cfg.vocab_size == 1000 and PRESETS["gpt-tiny"].vocab_size == 256
    assert gpt_config("llama-tiny", n_embd=128).ffn_size == 512  # derived fields follow replace()
    with pytest.raises(ValueError, match="multiple"):
        GPTConfig(n_head=4, n_kv_head=3, n_embd=64)


def _random_problem(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 17, 50, generator=generator)).to(dtype).requires_grad_()
    targets = torch.randint(0, 50, (3, 17), generator=generator)
    targets[0, :5] = -100
    targets[2, -3:] = -100
    return logits, targets


@pytest.mark.parametrize("chunk_size", [0, 1, 7, 128])
def test_chunked_cross_entropy_equals_cross_entropy(chunk_size: int) -> None:
    logits, targets = _random_problem()
    expected = F.cross_entropy(logits.view(-1, 50), targets.view(-1))
    (expected_grad,) = torch.autograd.grad(expected, logits)
    loss = chunked_cross_entropy(logits, targets, chunk_size=chunk_size)
    (grad,) = torch.autograd.grad(loss, logits)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)

    chunks = list(logits.split([5, 8, 4], dim=1))
    torch.testing.assert_close(chunked_cross_entropy(chunks, targets, chunk_size=chunk_size), expected)
    custom = chunked_cross_entropy(logits, targets.masked_fill(targets == -100, 7), chunk_size, ignore_index=7)
    torch.testing.assert_close(
        custom, F.cross_entropy(logits.view(-1, 50), targets.masked_fill(targets == -100, 7).view(-1), ignore_index=7)
    )


@pytest.mark.parametrize("chunk_size", [0, 7])
def test_chunked_cross_entropy_sums_what_cross_entropy_sums(chunk_size: int) -> None:
    logits, targets = _random_problem()
    expected = F.cross_entropy(logits.view(-1, 50), targets.view(-1), reduction="sum")
    (expected_grad,) = torch.autograd.grad(expected, logits)
    loss = chunked_cross_entropy(logits, targets, chunk_size=chunk_size, reduction="sum")
    (grad,) = torch.autograd.grad(loss, logits)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match='reduction must be "mean" or "sum"'):
        chunked_cross_entropy(logits, targets, reduction="none")


def test_chunked_cross_entropy_low_precision_keeps_no_float32_copy() -> None:
    logits, targets = _random_problem(torch.bfloat16)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = chunked_cross_entropy(logits, targets, chunk_size=8)
    extra = sum(t.numel() * t.element_size() for t in saved if t.untyped_storage().data_ptr() != logits.data_ptr())
    assert extra < logits.numel()  # nothing logits-sized beyond the logits themselves
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, F.cross_entropy(logits.float().view(-1, 50), targets.view(-1)))
    loss.backward()
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16


def test_python_docs_dataset_shapes_and_determinism() -> None:
    dataset = PythonDocsText(block_size=32)
    inputs, target = dataset[3]
    assert inputs.shape == target.shape == (32,) and inputs.dtype == target.dtype == torch.long
    torch.testing.assert_close(inputs[1:], target[:-1])
    assert int(dataset.data.max()) < dataset.vocab_size
    assert dataset.vocab_size > 1000 and len(dataset) > 100

    again, val = PythonDocsText(block_size=32), PythonDocsText(block_size=32, split="val")
    assert torch.equal(again.data, dataset.data) and again.dictionary.idx2word == dataset.dictionary.idx2word
    assert val.vocab_size == dataset.vocab_size and 0 < len(val) < len(dataset)
    assert isinstance(load_text_dataset(block_size=32), PythonDocsText)


def test_wikitext2_reads_local_folder(tmp_path: Path) -> None:
    (tmp_path / "wiki.train.tokens").write_text(" = Title = \n\n a b c a <unk> \n", encoding="utf-8")
    (tmp_path / "wiki.valid.tokens").write_text(" a zzz \n", encoding="utf-8")
    train = WikiText2(tmp_path, block_size=3)
    words = [train.dictionary.idx2word[int(i)] for i in train.data]
    assert words == ["=", "Title", "=", "<eos>", "<eos>", "a", "b", "c", "a", "<unk>", "<eos>"]
    assert len(train) == 11 // 3 - 1  # Lightning's count of blocks
    assert train[1][1].tolist() == train.data[4:7].tolist()
    val = WikiText2(tmp_path, block_size=2, split="val")
    assert val.vocab_size == train.vocab_size
    assert [val.dictionary.idx2word[int(i)] for i in val.data] == ["a", "<unk>", "<eos>"]


def test_missing_wikitext_folder_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir"
    with pytest.raises(FileNotFoundError, match="PythonDocsText") as info:
        load_text_dataset(missing)
    assert str(missing) in str(info.value)
