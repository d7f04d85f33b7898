"""The one way adapters replace a framework's functions: recorded, reversible, scoped where it can be.

More: docs/MODULES.md, core/integration/patching.py.
"""
from __future__ import annotations

import contextlib
import inspect
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

_MISSING = object()
_lock = threading.RLock()
_installed: "weakref.WeakKeyDictionary[Any, dict[str, Patch]]" = weakref.WeakKeyDictionary()


@dataclass
class Patch:
    owner: Any
    name: str
    original: Any  # as found in the owner's __dict__ (_MISSING: it was not there, e.g. inherited)
    replacement: Any

    def restore(self) -> None:
        """Put the original back, unless someone replaced our replacement meanwhile (then theirs
        stays, and still calls ours, which still calls the original)."""
        with _lock:
            patches = _installed.get(self.owner, {})
            if patches.get(self.name) is not self:
                return
            del patches[self.name]
            if vars(self.owner).get(self.name) is not self.replacement:
                return
            if self.original is _MISSING:
                delattr(self.owner, self.name)
            else:
                setattr(self.owner, self.name, self.original)


def _callable_of(value: Any) -> Any:
    return value.__func__ if isinstance(value, (staticmethod, classmethod)) else value


def install(owner: Any, name: str, make: Callable[[Any], Any]) -> Patch:
    """Replace ``owner.name`` with ``make(original)`` (the original as a plain function for
    static and class methods, bound for instance attributes inherited from the class)."""
    with _lock:
        existing = _installed.get(owner, {}).get(name)
        if existing is not None:
            return existing
        found = vars(owner).get(name, _MISSING)
        original = getattr(owner, name) if found is _MISSING else _callable_of(found)
        replacement = make(original)
        with contextlib.suppress(AttributeError):  # bound methods take no attributes
            replacement.__asyncckpt_original__ = original
        if isinstance(found, (staticmethod, classmethod)):
            replacement = type(found)(replacement)
        patch = Patch(owner, name, found, replacement)
        setattr(owner, name, replacement)
        _installed.setdefault(owner, {})[name] = patch
        return patch


@contextlib.contextmanager
def patched(owner: Any, name: str, value: Any) -> Iterator[Any]:
    """``owner.name`` is ``value`` inside the block (yields the original)."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield original
    finally:
        setattr(owner, name, original)


def install_on_subclasses(classes: Iterable[type], name: str, make: Callable[[Any], Any]) -> None:
    """``install`` on each of ``classes`` and on every subclass of them that defines its own ``name`` (a
    framework that gives each subclass a copy of the base's function: a patch of the base's alone does not
    reach them)."""
    pending = list(classes)
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if name in vars(cls):
            install(cls, name, make)


def caller(kind: type, accepts: Callable[[Any], bool]) -> Any:
    """The nearest caller up the stack that is a method of an instance of ``kind`` which ``accepts`` (a
    framework object that calls us without passing itself, as a Trainer calls its callbacks), or None."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, kind) and accepts(candidate):
                return candidate
            frame = frame.f_back
        return None
    finally:
        del frame


def overridden(instance: Any, base: type, name: str) -> bool:
    """Whether ``instance``'s class (or one between it and ``base``) has its own ``name``."""
    return getattr(type(instance), name) is not getattr(base, name)


@contextlib.contextmanager
def standing_in(base: type, name: str, instance: Any, replacement: Callable[..., Any]) -> Iterator[list]:
    """While active, the first call of ``base.name`` on ``instance`` (a subclass's ``super()`` call, however deep
    the subclassing) is ``replacement(*args)``; calls on other instances and any later call are ``base``'s own.
    Yields the list of the arguments ``replacement`` was called with (empty: never)."""
    native = getattr(base, name)
    calls: list = []

    def method(self: Any, *args: Any) -> Any:
        if self is not instance or calls:
            return native(self, *args)
        calls.append(args)
        return replacement(*args)

    with patched(base, name, method):
        yield calls


def installed() -> list[Patch]:
    with _lock:
        return [patch for patches in _installed.values() for patch in patches.values()]
