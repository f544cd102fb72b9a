"""Lightning names shardwise does not provide, importable so a ported script's imports still work.

A Lightning script changed only in its imports must either run as under
Lightning or stop at the first line that uses something shardwise lacks,
with the reason and what to use instead. `build_refused_class` makes a class
that raises at construction (so an import line, a type hint or an
`isinstance` check still works) and `build_refused_function` a function that
raises when called; neither ever runs as a silent no-op.
"""

from __future__ import annotations

from typing import Any, Callable


class NotProvidedError(NotImplementedError):
    """A Lightning name shardwise keeps importable but does not provide; the message says what to use."""


def _message(path: str, reason: str) -> str:
    return f"{path} is not provided by shardwise: {reason}"


def build_refused_class(name: str, module: str, reason: str) -> type:
    """A class named `name` (in `module`) whose construction raises NotProvidedError with `reason`."""
    path = f"{module}.{name}"

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise NotProvidedError(_message(path, reason))

    doc = f"Not provided (Lightning's {name}): {reason}"
    return type(name, (), {"__init__": __init__, "__doc__": doc, "__module__": module, "refused_reason": reason})


def build_refused_function(name: str, module: str, reason: str) -> Callable[..., Any]:
    """A function named `name` (in `module`) that raises NotProvidedError with `reason` when called."""
    path = f"{module}.{name}"

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise NotProvidedError(_message(path, reason))

    refused.__name__ = refused.__qualname__ = name
    refused.__module__ = module
    refused.__doc__ = f"Not provided (Lightning's {name}): {reason}"
    refused.refused_reason = reason  # type: ignore[attr-defined]
    return refused
