"""Which framework releases an adapter supports, and what it checks of a release newer than it was tested with.

More: docs/MODULES.md, core/integration/versions.py.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import importlib.util
import inspect
import io
import os
import textwrap
import threading
import tokenize
import warnings
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Callable, Mapping, Optional

from asyncckpt.core.errors import UnsupportedVersionError

ESSENTIAL = "essential"  # the feature without which the adapter does not run
ALLOW_CHANGED_ENV = "ASYNCCKPT_ALLOW_CHANGED"


@dataclass(frozen=True)
class Copied:
    """A framework function whose behaviour the adapter reproduces (in ``where``): ``digests`` are
    the ``code_digest`` of each variant the tested releases had."""

    where: str
    digests: tuple[str, ...]
    feature: str = ESSENTIAL


@dataclass(frozen=True)
class Called:
    """A framework function the adapter calls or replaces: its ``parameters`` as pinned
    (``"(first, second, ...)"`` pins the leading ones only), and the names the adapter replaces
    (``"torch.save"``) that it must still call for the replacement to see its writes."""

    parameters: str
    feature: str = ESSENTIAL
    calls: tuple[str, ...] = ()


@dataclass(frozen=True, eq=False)  # hashed by identity: checked once per object
class Support:
    """What an adapter supports and relies on (one per adapter, its single source of truth: the
    package's extras, the docs and the dev pins are checked against it by the test suite)."""

    package: str  # the framework's distribution name
    extra: str  # the adapter's pip extra (``pip install ".[extra]"`` in a clone)
    oldest: str  # the oldest release tested: refused below
    newest: str  # the newest release tested: above it, the pins are checked
    copied: Mapping[str, Copied] = field(default_factory=dict)  # "module:Qualified.name" -> Copied
    relied_on: Mapping[str, Called] = field(default_factory=dict)  # "module:Qualified.name" -> Called
    features: Mapping[str, str] = field(default_factory=dict)  # feature -> what the adapter does without it

    @property
    def requirement(self) -> str:
        """The dependency specifier users get: a lower bound only (no release is excluded before
        one is known to be incompatible)."""
        return f"{self.package}>={self.oldest}"


@dataclass(frozen=True)
class Release:
    """The installed release of a framework, as the rule judged it: ``refused`` maps each feature
    the adapter must do without to the changes that took it away."""

    version: str
    refused: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def allows(self, feature: str) -> bool:
        return feature not in self.refused


#: torch: no adapter pins (each fast path that uses a torch internal checks it once and falls back
#: with a warning: ``torch_file_images``, ``metadata_io``); the range is what the matrix ran.
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


def code_digest(source: str) -> str:
    """The digest pinned for a function's code: sha256 (first 16 hex digits) of its source without
    docstrings, comments, blank lines and trailing spaces. ``source`` is the function's own text
    (``inspect.getsource``, or the same lines read from a release's files)."""
    source = textwrap.dedent(source)
    lines = source.splitlines()
    drop: set[int] = set()  # 0-based lines that hold only docstrings
    blank: dict[int, list[tuple[int, int]]] = {}  # line -> column spans to blank (comments)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                drop.update(range(first.lineno - 1, first.end_lineno))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            blank.setdefault(token.start[0] - 1, []).append((token.start[1], token.end[1]))
    kept = []
    for number, line in enumerate(lines):
        if number in drop:
            continue
        for start, end in sorted(blank.get(number, ()), reverse=True):
            line = line[:start] + line[end:]
        if line.strip():
            kept.append(line.rstrip())
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()[:16]


def parameters(function: Callable[..., Any]) -> str:
    """A function's parameter names as pinned, e.g. ``"(self, output_dir, *args, **kwargs)"``."""
    prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    # not followed through ``__wrapped__``: what callers meet is the function's own signature (transformers'
    # auto classes' from_pretrained copies say they wrap a bound method, which has no ``cls``)
    signature = inspect.signature(function, follow_wrapped=False)
    names = [prefix.get(p.kind, "") + p.name for p in signature.parameters.values()]
    return f"({', '.join(names)})"


def called_names(source: str) -> set[str]:
    """Every name and dotted attribute chain a function's code refers to (``save``, ``torch.save``)."""
    found = set()
    for node in ast.walk(ast.parse(textwrap.dedent(source))):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            chain, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name):
                found.add(".".join([inner.id, *reversed(chain)]))
    return found


def installed_function(target: str) -> tuple[str, str]:
    """The source and parameters of ``target`` in the installed release (``changes``' default lookup)."""
    function = resolve(target)
    return inspect.getsource(function), parameters(function)


def changes(support: Support, lookup: Callable[[str], Optional[tuple[str, str]]] = installed_function,
            ) -> dict[str, list[str]]:
    """Each pinned function that differs from what was tested, with how, by feature (empty:
    everything the adapter relies on is as tested). ``lookup`` gives a target's source and
    parameters (None: it cannot tell, the pin is skipped); by default, the installed release's."""
    found: dict[str, list[str]] = {}
    pins = [*support.copied.items(), *((t, c) for t, c in support.relied_on.items() if _installed(t, support))]
    for target, pin in pins:  # an optional package (peft) that is absent: nothing relies on it
        try:
            looked_up = lookup(target)
            if looked_up is None:
                continue
            source, actual = looked_up
            if isinstance(pin, Copied):
                digest = code_digest(source)
                how = [] if digest in pin.digests else [
                    f"code changed: digest {digest}, tested {', '.join(pin.digests)}; reproduced in {pin.where}"]
            else:
                missing = sorted(set(pin.calls) - called_names(source))
                how = ([] if _same_parameters(actual, pin.parameters) else
                       [f"parameters {actual}, tested {pin.parameters}"]) + \
                      ([f"no longer calls {', '.join(missing)}, which the adapter replaces"] if missing else [])
        except (ImportError, AttributeError, OSError, TypeError, ValueError, SyntaxError) as e:
            how = [f"not found: {type(e).__name__}: {e}"]
        found.setdefault(pin.feature, []).extend(f"{target} ({change})" for change in how)
    return {feature: listed for feature, listed in found.items() if listed}


def _installed(target: str, support: Support) -> bool:
    top = target.split(".", 1)[0]
    return top == support.package or importlib.util.find_spec(top) is not None


def _same_parameters(actual: str, expected: str) -> bool:
    if not expected.endswith(", ...)"):
        return actual == expected
    leading = expected[:-len(", ...)")]
    return actual == leading + ")" or actual.startswith(leading + ", ")


def _allowed_changed(package: str) -> bool:
    allowed = {name.strip().lower() for name in os.environ.get(ALLOW_CHANGED_ENV, "").split(",")}
    return bool({"all", "1", package.lower()} & allowed)


_lock = threading.Lock()


def require(support: Support) -> Release:
    """The installed release of ``support.package``, with the features the adapter must do without
    (see the module docstring); raises ``UnsupportedVersionError`` where the adapter cannot run at
    all. Judged once per process, warned once."""
    with _lock:
        return _checked(support)


@functools.lru_cache(maxsize=None)
def _checked(support: Support) -> Release:
    from packaging.version import Version  # every supported framework depends on packaging

    try:
        installed = version(support.package)
    except PackageNotFoundError:
        raise UnsupportedVersionError(
            f"asyncckpt's {support.extra} adapter needs {support.requirement}, which is not installed "
            f"(pip install '{support.requirement}')") from None
    release = Version(Version(installed).base_version)
    if release < Version(support.oldest):
        raise UnsupportedVersionError(
            f"asyncckpt's {support.extra} adapter supports {support.requirement} (tested {support.oldest} to "
            f"{support.newest}); {support.package} {installed} is installed and older. Upgrade {support.package}.")
    if release <= Version(support.newest):
        return Release(installed)
    tested = f"asyncckpt's {support.extra} adapter was tested with {support.package} up to {support.newest}"
    changed = changes(support)
    if not changed:
        warnings.warn(f"{tested}; the functions asyncckpt relies on are unchanged in {installed}",
                      UserWarning, stacklevel=4)
        return Release(installed)
    listed = "; ".join(change for found in changed.values() for change in found)
    if _allowed_changed(support.package):
        warnings.warn(f"{tested}; {support.package} {installed} changed functions it relies on, used anyway at your "
                      f"own risk ({ALLOW_CHANGED_ENV}): {listed}", UserWarning, stacklevel=4)
        return Release(installed)
    unknown = set(changed) - set(support.features)
    if unknown:
        raise UnsupportedVersionError(
            f"{tested}; {support.package} {installed} changed functions it relies on: {listed}. Install "
            f"{support.package}<={support.newest}, or an asyncckpt release that supports {installed}, or set "
            f"{ALLOW_CHANGED_ENV}={support.package} to use it at your own risk.")
    for feature, found in changed.items():
        warnings.warn(f"{tested}; {support.package} {installed} changed functions of its {feature} support: "
                      f"{'; '.join(found)}. {support.features[feature]} (or set {ALLOW_CHANGED_ENV}="
                      f"{support.package} to use asyncckpt's at your own risk)", UserWarning, stacklevel=4)
    return Release(installed, {feature: tuple(found) for feature, found in changed.items()})
