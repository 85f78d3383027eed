"""References to a user's code in config: `pkg.module:name` (a task factory, a reward function).

    fn = resolve("my_pkg.rewards:score", what="task.reward")    # ValueError saying how to fix it

Where the user extends the system, config names a function by reference instead of the user editing the
project. The reference is resolved at startup (a wrong one fails before any process starts) and again
in every process that calls it (the actor, its grading workers): it must be importable there, i.e.
installed or on PYTHONPATH, which every child of the launcher inherits.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

REFERENCE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def is_reference(text: str) -> bool:
    return bool(REFERENCE.fullmatch(text))


def resolve(reference: str, what: str) -> Any:
    """The object `pkg.module:attr[.attr]` names; ValueError naming `what` (the config key) on failure."""
    if not is_reference(reference):
        raise ValueError(
            f"{what}={reference!r} is not a reference: write pkg.module:name (e.g. my_pkg.rewards:score)"
        )
    module_name, _, attr_path = reference.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"{what}={reference!r}: cannot import {module_name} ({type(e).__name__}: {e}): install the package "
            "that holds it (pip install -e .) or put its directory on PYTHONPATH"
        ) from None
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{what}={reference!r}: {module_name} has no {attr_path!r}") from None
    return obj


def resolve_callable(reference: str, what: str) -> Callable:
    fn = resolve(reference, what)
    if not callable(fn):
        raise ValueError(f"{what}={reference!r} names a {type(fn).__name__}, not a function")
    return fn
