# The MemoryTracker's public hooks for callers that need more than one peak (the memory
# planner records an envelope per training phase through them): on_change, ignore_op,
# the transient window, relabel, and gradients of fake parameters labelled as they land.
# Sizes are known to the byte, as in test_memory.py.
import pytest
import torch

from shardwise import memory as M

F32 = 4


@pytest.fixture(autouse=True)
def _no_tracker_left_behind(monkeypatch):
    monkeypatch.setattr(M, "_LAST", None)
    monkeypatch.setattr(M, "_WARNED_OFF", False)
    yield
    if M.active_tracker() is not None:
        M.stop_tracking()
        pytest.fail("test left a MemoryTracker running")


def test_on_change_reports_the_live_counts_after_every_op_and_resize():
    seen = []
    with M.MemoryTracker(on_change=lambda counts: seen.append(sum(counts.values()))) as tracker:
        a = torch.empty(1000)  # 4000 bytes
        b = torch.empty(500)  # 2000 bytes
        assert seen[-2:] == [4000, 6000]
        del a
        torch.empty(0)  # the next op sees the free
        assert seen[-1] == 2000
        b.untyped_storage().resize_(0)  # no dispatch: reported by the resize hook
        assert seen[-1] == 0 and tracker.current_bytes == 0
    # The mapping is the tracker's live view: read-only.
    view = []
    with M.MemoryTracker(on_change=view.append):
        torch.empty(10)
    with pytest.raises(TypeError):
        view[-1]["activations"] = 0


def test_ignore_op_leaves_ops_uncounted_and_unreported():
    skip = [False]
    seen = []
    with M.MemoryTracker(on_change=seen.append, ignore_op=lambda: skip[0]) as tracker:
        skip[0] = True
        ghost = torch.empty(1000)
        skip[0] = False
        assert tracker.current_bytes == 0 and seen == []
        kept = torch.empty(1000)
        assert tracker.current_bytes == 4000 and len(seen) == 1
    del ghost, kept


def test_transient_window_finds_the_largest_block_born_and_freed_inside_it():
    with M.MemoryTracker() as tracker:
        old = torch.empty(5000)  # born before the window: its free does not count
        tracker.begin_transient_window()
        big = torch.empty(2000)  # 8000 bytes, freed below
        small = torch.empty(100)
        del big, old
        torch.empty(0)
        assert tracker.largest_transient_bytes == 8000
        unsharded = torch.empty(3000)
        unsharded.untyped_storage().resize_(0)  # shrunk away, as FSDP2 frees: counts its size before
        assert tracker.largest_transient_bytes == 12000
        tracker.begin_transient_window()
        assert tracker.largest_transient_bytes == 0
        del small
    assert M.MemoryTracker().largest_transient_bytes == 0


def test_relabel_moves_live_storages_between_categories_and_the_peak_follows():
    model = torch.nn.Linear(64, 64)
    x = torch.randn(16, 64)
    with M.MemoryTracker().register(model) as tracker:
        out = model(x)  # 16 x 64 float32 activation
        act = tracker.current_breakdown["activations"]
        assert act == 16 * 64 * F32
        assert tracker.relabel("gradients") == act
        now = tracker.current_breakdown
        assert now["activations"] == 0 and now["gradients"] == act
        assert tracker.peak_breakdown["gradients"] == act  # it was alive at the peak
        assert tracker.relabel("gradients") == 0  # nothing left to move
        with pytest.raises(ValueError, match="Unknown category 'grads'"):
            tracker.relabel("grads")
    del out


def test_gradients_of_fake_parameters_are_labelled_as_they_land():
    from torch._subclasses.fake_tensor import FakeTensorMode

    during = []
    with FakeTensorMode():
        model = torch.nn.Linear(256, 256)
        x = torch.randn(8, 256)
        tracker = M.MemoryTracker(count_fake=True, on_change=lambda c: during.append(dict(c)))
        with tracker.register(model):
            model(x).sum().backward()
            torch.empty(0)  # the next op reports what the gradient hooks labelled
            # Read it before anything scans the registered model.
            at_end = dict(during[-1])
    # Without the hook they would count as activations until something scanned the model.
    assert at_end["gradients"] == (256 * 256 + 256) * F32
