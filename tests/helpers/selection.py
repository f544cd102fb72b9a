"""Which cases of a module's tests the current pytest session selected, for module fixtures that run
those cases together in one launch of worker processes (process start-up costs more than most of
these runs): a deselected case (`-k`, `-m "not slow"`, a node id) is not run for nothing, and every
selected case still gets its own result and its own test outcome."""

from __future__ import annotations

from typing import Any, Iterable, List


def selected_params(request: Any, argname: str, tests: Iterable[str]) -> List[Any]:
    """The values of the parameter `argname` of the selected items of `tests` (test function names) in
    the module of the requesting module fixture, in collection order, without repeats."""
    names = set(tests)
    values: List[Any] = []
    for item in request.session.items:
        if item.module is not request.module or getattr(item, "originalname", None) not in names:
            continue
        callspec = getattr(item, "callspec", None)
        if callspec is not None and argname in callspec.params and callspec.params[argname] not in values:
            values.append(callspec.params[argname])
    return values
