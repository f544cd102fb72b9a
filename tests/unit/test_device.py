"""shardwise.move_to_device: every batch shape a DataLoader yields reaches the device (issue 15).

The target is the meta device: a real move on any machine, and any tensor
left behind is visibly still on the CPU.
"""

from collections import OrderedDict, UserDict, defaultdict, namedtuple
from dataclasses import dataclass, field

import pytest
import torch
from torch.nn.utils.rnn import pack_sequence

import shardwise
from shardwise.distributed.device import _non_blocking, move_to_device

META = torch.device("meta")
Pair = namedtuple("Pair", ["inputs", "labels"])


@dataclass
class Batch:
    input_ids: torch.Tensor
    extra: dict
    name: str = "b"
    cached: torch.Tensor = field(default=None, init=False)


@dataclass(frozen=True)
class Frozen:
    x: torch.Tensor


class Custom:
    """An object with its own .to (PyG's Data, a user's batch class)."""

    def __init__(self, x):
        self.x = x

    def to(self, device):
        return Custom(self.x.to(device))


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (dict, UserDict)):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def test_exported_as_shardwise_move_to_device():
    assert shardwise.move_to_device is move_to_device


def test_hugging_face_batch_encoding_keeps_its_type_and_is_not_modified():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import BatchEncoding, DataCollatorWithPadding, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1, "a": 2, "b": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")
    batch = DataCollatorWithPadding(tokenizer, return_tensors="pt")([tokenizer("a b a"), tokenizer("b")])
    assert isinstance(batch, BatchEncoding) and batch["input_ids"].device.type == "cpu"

    moved = move_to_device(batch, "meta")
    assert isinstance(moved, BatchEncoding)
    assert set(moved.keys()) == set(batch.keys()) and {"input_ids", "attention_mask"} <= set(moved.keys())
    assert all(t.device == META for t in _tensors(moved))
    assert moved.input_ids.shape == (2, 3)  # attribute access still works
    assert moved.encodings is batch.encodings  # its other state is kept
    assert batch["input_ids"].device.type == "cpu"  # the caller's batch is untouched


def test_containers_keep_their_types():
    t = torch.arange(4)
    batch = {
        "pair": Pair(t, t + 1),
        "list": [t, (t, 3)],
        "od": OrderedDict(a=t),
        "dd": defaultdict(list, b=t),
        "user": UserDict(c=t),
        "text": ["not", "tensors"],
        "n": 7,
        "none": None,
    }
    moved = move_to_device(batch, META)
    assert type(moved["pair"]) is Pair and moved["pair"].labels.device == META
    assert type(moved["list"]) is list and type(moved["list"][1]) is tuple and moved["list"][1][1] == 3
    assert type(moved["od"]) is OrderedDict and type(moved["dd"]) is defaultdict and moved["dd"].default_factory is list
    assert type(moved["user"]) is UserDict
    assert moved["text"] == ["not", "tensors"] and moved["n"] == 7 and moved["none"] is None
    assert all(x.device == META for x in _tensors(moved))
    assert all(x.device.type == "cpu" for x in _tensors(batch))


def test_dataclass_fields_are_replaced_on_a_copy():
    batch = Batch(torch.ones(2), {"mask": torch.zeros(2)})
    batch.cached = torch.ones(1)
    moved = move_to_device(batch, META)
    assert type(moved) is Batch and moved is not batch
    assert moved.input_ids.device == META and moved.extra["mask"].device == META and moved.cached.device == META
    assert moved.name == "b" and batch.input_ids.device.type == "cpu"
    assert move_to_device(Frozen(torch.ones(1)), META).x.device == META


def test_objects_with_their_own_to_method_use_it():
    assert move_to_device(Custom(torch.ones(3)), META).x.device == META
    # PackedSequence is a namedtuple with a .to that keeps batch_sizes on the host, as it must.
    packed = move_to_device(pack_sequence([torch.ones(3), torch.ones(2)]), META)
    assert packed.data.device == META and packed.batch_sizes.device.type == "cpu"


def test_tensor_already_there_is_returned_as_is():
    t = torch.ones(2)
    assert move_to_device(t, "cpu") is t


def test_non_blocking_only_from_pinned_or_cuda_memory_to_cuda(monkeypatch):
    t = torch.ones(2)
    cuda = torch.device("cuda", 0)
    assert not _non_blocking(t, torch.device("cpu")) and not _non_blocking(t, META)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: False)
    assert not _non_blocking(t, cuda)  # pageable host memory: a synchronous copy
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    assert _non_blocking(t, cuda)  # pinned: overlaps with compute
    assert not _non_blocking(t, torch.device("cpu"))  # to the host: never before the data is there


@pytest.mark.parametrize("device", ["meta", torch.device("meta")])
def test_device_given_as_string_or_device(device):
    assert move_to_device([torch.ones(1)], device)[0].device == META
