"""Which framework versions an adapter supports, and what it checks of a release newer than it was tested with.

An adapter relies on a few functions of its framework: it reproduces the behaviour of some (each
pinned by the digest of its source, one digest per variant a tested release had) and calls or
replaces others (each pinned by its parameters). Its ``Support`` names them, with the oldest and
newest release the compatibility matrix ran (docs/compatibility.md). The rule, applied once at
the adapter's construction:

* below ``oldest``: refused (``UnsupportedVersionError``), as nothing older was tested;
* ``oldest`` to ``newest``: works;
* above ``newest`` (a release that came out after this asyncckpt): every pinned function is
  compared with what was tested. Unchanged, the adapter works and warns once ("tested up to X;
  the functions asyncckpt relies on are unchanged in Y"); changed, it refuses, naming each
  function that changed. A framework release that leaves the checkpoint code alone therefore
  works on release day, and one that changes it fails at construction, not in the middle of a run.

The contract tests (``tests/test_framework_contracts.py``) run the same comparison on the
installed release, so a pin and the runtime check cannot disagree.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import threading
import warnings
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Callable, Mapping

from asyncckpt.core.errors import UnsupportedVersionError


@dataclass(frozen=True)
class Copied:
    """A framework function whose behaviour an adapter reproduces: ``digests`` are the source
    digests of the variants the adapter's copy (``where``) was tested against."""

    where: str
    digests: tuple[str, ...]


@dataclass(frozen=True, eq=False)  # hashed by identity: checked once per object
class Support:
    """What an adapter supports and relies on (one per adapter, its single source of truth: the
    package's extras, the docs and the dev pins are checked against it by the test suite)."""

    package: str  # the framework's distribution name
    extra: str  # the adapter's pip extra (``pip install "asyncckpt[extra]"``)
    oldest: str  # the oldest release tested: refused below
    newest: str  # the newest release tested: above it, the pins are checked
    copied: Mapping[str, Copied] = field(default_factory=dict)  # "module:Qualified.name" -> Copied
    # "module:Qualified.name" -> "(its, parameters)"; "(first, second, ...)" pins the leading ones only
    relied_on: Mapping[str, str] = field(default_factory=dict)

    @property
    def requirement(self) -> str:
        """The dependency specifier users get: a lower bound only (no release is excluded before
        one is known to be incompatible)."""
        return f"{self.package}>={self.oldest}"


#: torch: no adapter pins (each fast path that uses a torch internal checks it once and falls back
#: with a warning: ``torch_file``, ``metadata_io``); the range is what the matrix ran.
TORCH = Support(package="torch", extra="", oldest="2.9.0", newest="2.15.0")


def resolve(target: str) -> Callable[..., Any]:
    """``"module:Owner.name"`` as the framework defines it: an adapter's replacement (installed
    through ``patching``) is looked through, static and class methods are unwrapped."""
    module, _, attribute = target.rpartition(":")
    owner: Any = importlib.import_module(module)
    *path, name = attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    value = vars(owner)[name] if name in vars(owner) else getattr(owner, name)
    value = getattr(value, "__func__", value)
    return getattr(value, "__asyncckpt_original__", value)


def source_digest(function: Callable[..., Any]) -> str:
    """The digest pinned for a copied function: sha256 of its source, first 16 hex digits."""
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()[:16]


def parameters(function: Callable[..., Any]) -> str:
    """A function's parameter names as pinned, e.g. ``"(self, output_dir, *args, **kwargs)"``."""
    prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    # not followed through ``__wrapped__``: what callers meet is the function's own signature (transformers'
    # auto classes' from_pretrained copies say they wrap a bound method, which has no ``cls``)
    signature = inspect.signature(function, follow_wrapped=False)
    names = [prefix.get(p.kind, "") + p.name for p in signature.parameters.values()]
    return f"({', '.join(names)})"


def changes(support: Support) -> list[str]:
    """Each pinned function that differs in the installed release from what was tested, with how
    (empty: everything the adapter relies on is as tested)."""
    found = []
    for target, copied in support.copied.items():
        try:
            digest = source_digest(resolve(target))
        except (ImportError, AttributeError, OSError, TypeError) as e:
            found.append(f"{target} (not found: {type(e).__name__}: {e})")
            continue
        if digest not in copied.digests:
            found.append(f"{target} (source changed: digest {digest}, tested {', '.join(copied.digests)}; "
                         f"reproduced in {copied.where})")
    for target, expected in support.relied_on.items():
        if not _installed(target, support):
            continue  # an optional package (peft) that is absent: nothing relies on it
        try:
            actual = parameters(resolve(target))
        except (ImportError, AttributeError, TypeError, ValueError) as e:
            found.append(f"{target} (not found: {type(e).__name__}: {e})")
            continue
        if not _same_parameters(actual, expected):
            found.append(f"{target} (parameters {actual}, tested {expected})")
    return found


def _installed(target: str, support: Support) -> bool:
    top = target.split(".", 1)[0]
    return top == support.package or importlib.util.find_spec(top) is not None


def _same_parameters(actual: str, expected: str) -> bool:
    if not expected.endswith(", ...)"):
        return actual == expected
    leading = expected[:-len(", ...)")]
    return actual == leading + ")" or actual.startswith(leading + ", ")


_lock = threading.Lock()


def require(support: Support) -> str:
    """The installed release of ``support.package`` if the adapter may run with it (see the module
    docstring); raises ``UnsupportedVersionError`` otherwise. Checked once per process."""
    with _lock:
        return _checked(support)


@functools.lru_cache(maxsize=None)
def _checked(support: Support) -> str:
    from packaging.version import Version  # every supported framework depends on packaging

    try:
        installed = version(support.package)
    except PackageNotFoundError:
        raise UnsupportedVersionError(
            f"asyncckpt's {support.extra} adapter needs {support.requirement}, which is not installed "
            f"(pip install 'asyncckpt[{support.extra}]')") from None
    release = Version(Version(installed).base_version)
    if release < Version(support.oldest):
        raise UnsupportedVersionError(
            f"asyncckpt's {support.extra} adapter supports {support.requirement} (tested {support.oldest} to "
            f"{support.newest}); {support.package} {installed} is installed and older. Upgrade {support.package}.")
    if release <= Version(support.newest):
        return installed
    changed = changes(support)
    if changed:
        raise UnsupportedVersionError(
            f"asyncckpt's {support.extra} adapter was tested with {support.package} up to {support.newest}; "
            f"{support.package} {installed} changed functions it relies on: " + "; ".join(changed)
            + f". Install {support.package}<={support.newest}, or an asyncckpt release that supports {installed}.")
    warnings.warn(f"asyncckpt's {support.extra} adapter was tested with {support.package} up to {support.newest}; "
                  f"the functions asyncckpt relies on are unchanged in {installed}", UserWarning, stacklevel=4)
    return installed
