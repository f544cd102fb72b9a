# Tests for shardwise.memory: tracked tensor memory must be exact and deterministic,
# because other tests (and BENCHMARKS.md) assert ratios on it. Single-process tests
# use allocations whose sizes we know to the byte; one 2-rank gloo test (shardwise.launch)
# checks the numbers the strategies depend on: DDP replicates parameters, gradients
# and optimizer state, FSDP2 holds half of each per rank, and DDP's C++ gradient
# buckets are counted.
import json
import warnings

import pytest
import torch
import torch.distributed as dist

from shardwise import memory as M

F32 = 4


@pytest.fixture(autouse=True)
def _no_tracker_left_behind(monkeypatch):
    monkeypatch.setattr(M, "_LAST", None)
    monkeypatch.setattr(M, "_WARNED_OFF", False)
    yield
    if M.active_tracker() is not None:  # a failing test must not leak a dispatch mode
        M.stop_tracking()
        pytest.fail("test left a MemoryTracker running")


def _linear_adam():
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024)
    return model, torch.optim.Adam(model.parameters())


def test_exact_accounting_linear_adam():
    model, opt = _linear_adam()
    param_bytes = (1024 * 1024 + 1024) * F32  # 4 MiB weight + 4 KiB bias
    x = torch.randn(8, 1024)
    tracker = M.MemoryTracker().register(model, [opt])
    with tracker:
        start = tracker.current_breakdown
        assert start["parameters"] == param_bytes
        assert tracker.current_bytes == param_bytes

        model(x).square().mean().backward()
        after_backward = tracker.current_breakdown
        assert after_backward["gradients"] == param_bytes

        opt.step()
        after_step = tracker.current_breakdown
        # exp_avg + exp_avg_sq, plus Adam's float32 `step` scalar per parameter tensor
        assert after_step["optimizer"] == 2 * param_bytes + 2 * F32
        assert after_step["parameters"] == param_bytes
        assert after_step["buffers"] == 0

        opt.zero_grad()
        assert tracker.current_breakdown["gradients"] == 0

    peak = tracker.peak_breakdown
    assert sum(peak.values()) == tracker.peak_bytes
    # The peak is inside the first step: everything resident plus Adam's temporaries.
    assert peak["parameters"] == param_bytes and peak["gradients"] == param_bytes
    assert peak["optimizer"] >= 2 * param_bytes
    assert tracker.peak_bytes >= 4 * param_bytes


def test_peak_of_known_allocation_sequence():
    with M.MemoryTracker() as tracker:
        a = torch.empty(1000)  # 4000 B
        b = torch.empty(2000)  # 8000 B
        assert tracker.current_bytes == 12000 and tracker.peak_bytes == 12000
        view = b.view(-1)[10:]  # views and in-place ops on known storage allocate nothing
        view.add_(1.0)
        del a
        c = torch.empty(500, dtype=torch.float64)  # 4000 B
        assert tracker.current_bytes == 12000 and tracker.peak_bytes == 12000
        del c
        assert tracker.current_bytes == 8000
        # Outside any forward/backward/optimizer step, allocations are "other".
        assert tracker.peak_breakdown == dict.fromkeys(M.CATEGORIES, 0) | {"other": 12000}

        tracker.reset_peak()
        assert tracker.peak_bytes == 8000
        d = torch.empty(100, 10)
        assert tracker.peak_bytes == 12000
        del b, view, d
        assert tracker.current_bytes == 0


def test_forward_allocations_are_activations_and_grads_recategorised():
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1))
    x = torch.randn(32, 256)
    with M.MemoryTracker().register(model) as tracker:
        out = model(x)
        acts = tracker.current_breakdown["activations"]
        # relu output (32x512) + model output (32x1), float32. The first Linear's
        # output is already freed: ReLU's backward needs only ReLU's result.
        assert acts == (32 * 512 + 32) * F32
        out.sum().backward()
        del out
        now = tracker.current_breakdown
    param_bytes = sum(p.numel() for p in model.parameters()) * F32
    assert now["gradients"] == param_bytes and now["activations"] == 0
    peak = tracker.peak_breakdown
    # Gradients were born as anonymous backward outputs; the peak split names them.
    assert peak["gradients"] <= param_bytes and sum(peak.values()) == tracker.peak_bytes


def test_storage_resize_is_followed():
    # FSDP2 frees and re-allocates unsharded parameters with UntypedStorage.resize_,
    # which bypasses the dispatcher.
    with M.MemoryTracker() as tracker:
        t = torch.empty(1000)
        t.untyped_storage().resize_(0)
        assert tracker.current_bytes == 0
        t.untyped_storage().resize_(4000 * 2)
        assert tracker.current_bytes == 8000 and tracker.peak_bytes == 8000
    assert torch.UntypedStorage.resize_.__name__ == "resize_"


def test_nothing_tracked_when_off():
    from torch.nn.modules import module as nn_module
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    hooks_before = len(nn_module._global_forward_hooks)
    original_resize = torch.UntypedStorage.resize_
    with pytest.warns(UserWarning, match="track_memory"):
        assert M.max_memory_allocated() == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning is given once only
        assert M.max_memory_allocated("cpu") == 0
        assert M.memory_allocated() == 0

    tracker = M.MemoryTracker()
    with tracker:
        assert _get_current_dispatch_mode() is not None
        x = torch.empty(256)
    peak = tracker.peak_bytes
    y = torch.empty(10_000)  # after stop: unseen
    assert tracker.peak_bytes == peak == 1024
    assert _get_current_dispatch_mode() is None
    assert len(nn_module._global_forward_hooks) == hooks_before
    assert torch.UntypedStorage.resize_ is original_resize
    del x, y


def test_process_wide_functions_and_single_active_tracker():
    model, opt = _linear_adam()
    with M.track_memory(model, opt) as tracker:
        assert M.active_tracker() is tracker
        with pytest.raises(RuntimeError, match="already running"):
            M.MemoryTracker().start()
        # A nested track_memory() joins the running tracker and does not stop it.
        with M.track_memory() as inner:
            assert inner is tracker
        assert tracker.active
        buf = torch.empty(1024)
        assert M.memory_allocated() == tracker.current_bytes
        assert M.max_memory_allocated("cpu") == tracker.peak_bytes
    assert M.active_tracker() is None
    # The peak stays readable after tracking stopped, until it is reset.
    assert M.max_memory_allocated() == tracker.peak_bytes > 0
    M.reset_peak_memory_stats()
    with pytest.warns(UserWarning):
        assert M.max_memory_allocated() == 0

    started = M.start_tracking()
    assert M.active_tracker() is started
    assert M.stop_tracking() is started and M.active_tracker() is None
    del buf


def test_fake_tensor_mode_counts_fake_storages():
    # The memory planner runs real code under fake tensors; sizes must match eager.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model, opt = _linear_adam()
        x = torch.randn(8, 1024)
        with M.MemoryTracker().register(model, opt) as tracker:
            model(x).sum().backward()
            opt.step()
        after = tracker.current_breakdown
    param_bytes = (1024 * 1024 + 1024) * F32
    assert after["parameters"] == after["gradients"] == param_bytes
    assert after["optimizer"] == 2 * param_bytes + 2 * F32


def test_format_and_parse_bytes():
    assert M.format_bytes(512) == "512 B"
    assert M.format_bytes(12.3 * 2**20) == "12.3 MiB"
    assert M.format_bytes(80 * 2**30) == "80.0 GiB"
    assert M.parse_bytes("80GiB") == 80 * 2**30
    assert M.parse_bytes("80GB") == 80 * 10**9
    assert M.parse_bytes("512MiB") == 512 * 2**20
    assert M.parse_bytes("1.5TiB") == int(1.5 * 2**40)
    assert M.parse_bytes(" 64 kib ") == 64 * 1024
    assert M.parse_bytes("4096") == M.parse_bytes(4096) == 4096
    assert M.parse_bytes("16G") == 16 * 2**30
    for bad in ("80 GiBs", "lots", "", "-1GB", "1.2.3MB"):
        with pytest.raises(ValueError, match="80GiB") as err:
            M.parse_bytes(bad)
        assert repr(bad) in str(err.value)
    with pytest.raises(ValueError):
        M.parse_bytes(-5)


def test_peak_rss_resets_to_what_is_live_now():
    import mmap

    size = 128 * 2**20
    block = mmap.mmap(-1, size)  # anonymous pages, returned to the kernel on close (a heap might keep them)
    block.write(b"\1" * size)  # touched: resident
    assert M.peak_rss_bytes() >= M.current_rss_bytes() >= size
    block.close()
    after_free = M.current_rss_bytes()
    assert M.peak_rss_bytes() - after_free > 100 * 2**20  # the freed block still counts toward the peak
    if not M.reset_peak_rss():  # a read-only /proc: says so, and the peak stays the peak since start
        pytest.skip("/proc/self/clear_refs is not writable here")
    assert M.peak_rss_bytes() - after_free < 16 * 2**20  # the peak is now what is live, not the freed block


def test_reset_peak_rss_refused_warns_once_and_returns_false(monkeypatch):
    import builtins

    from shardwise import sysmem

    real_open = builtins.open

    def read_only_proc(path, *args, **kwargs):
        if str(path) == "/proc/self/clear_refs":
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", read_only_proc)
    monkeypatch.setattr(sysmem, "_WARNED_CLEAR_REFS", False)
    with pytest.warns(UserWarning, match="cannot reset the RSS high-water mark"):
        assert M.reset_peak_rss() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert M.reset_peak_rss() is False  # said once, not at every call


# --------------------------------------------------------------------- 2 ranks
N_LAYERS, WIDTH = 8, 256


def _dist_worker() -> dict:
    # Started by shardwise.launch (its forkserver has torch imported): RANK, WORLD_SIZE, MASTER_* are set.
    dist.init_process_group("gloo")
    try:
        from torch.distributed.fsdp import fully_shard
        from torch.nn.parallel import DistributedDataParallel as DDP

        results = {}
        for kind in ("ddp_view", "ddp_copy", "fsdp"):
            torch.manual_seed(0)
            model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(N_LAYERS)])
            if kind == "fsdp":
                for layer in model:
                    fully_shard(layer)
                fully_shard(model)
            else:
                model = DDP(model, gradient_as_bucket_view=(kind == "ddp_view"))
            opt = torch.optim.Adam(model.parameters())
            x = torch.randn(4, WIDTH)
            with M.track_memory(model, opt) as tracker:
                start = tracker.current_breakdown
                for step in range(2):
                    model(x).square().mean().backward()
                    if step == 0:
                        after_backward = tracker.current_breakdown
                    opt.step()
                    opt.zero_grad()
                end = tracker.current_breakdown
            results[kind] = dict(
                start=start,
                after_backward=after_backward,
                end=end,
                peak=tracker.peak_bytes,
                peak_breakdown=tracker.peak_breakdown,
            )
            del model, opt
        return json.loads(json.dumps(results))  # plain values, as the files it used to write held
    finally:
        dist.destroy_process_group()


def test_ddp_and_fsdp2_per_rank_memory_two_ranks():
    import shardwise

    per_rank = shardwise.launch(_dist_worker, devices=2)
    full = N_LAYERS * (WIDTH * WIDTH + WIDTH) * F32  # unsharded parameter bytes
    steps = 2 * N_LAYERS * F32  # Adam's `step` scalars, one per parameter tensor
    for rank in range(2):
        r = per_rank[rank]
        for kind, res in r.items():
            assert sum(res["peak_breakdown"].values()) == res["peak"], kind

        ddp = r["ddp_view"]
        assert ddp["start"]["parameters"] == full
        # Grads are views of the reducer's C++ bucket: counting them counts the bucket.
        assert ddp["after_backward"]["gradients"] == full
        assert ddp["end"]["optimizer"] == 2 * full + steps
        assert ddp["end"]["gradients"] == full  # zero_grad drops .grad, the bucket stays

        copy = r["ddp_copy"]
        # Without bucket views DDP holds the gradients twice: .grad and the bucket.
        assert copy["after_backward"]["gradients"] == 2 * full
        assert copy["peak"] > ddp["peak"]

        fsdp = r["fsdp"]
        assert fsdp["start"]["parameters"] == full // 2  # sizes divide evenly: no padding
        assert fsdp["after_backward"]["gradients"] == full // 2
        assert fsdp["end"]["optimizer"] == full + steps
        assert fsdp["end"]["gradients"] == 0
        # Gathered (unsharded) layers are counted as parameters while they live.
        assert fsdp["peak_breakdown"]["parameters"] > full // 2
        assert fsdp["peak"] <= 0.6 * ddp["peak"]
