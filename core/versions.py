"""Which framework versions an adapter supports, checked when it is set up.

An adapter relies on a few private functions of its framework (``tests/test_framework_contracts.py``
pins them); outside the versions it was tested with it refuses clearly, at construction, rather
than failing strangely in the middle of a run.
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from .errors import UnsupportedVersionError


def require(package: str, supported: str, adapter: str) -> str:
    """The installed version of ``package``; raises ``UnsupportedVersionError`` unless it is in
    ``supported`` (a PEP 440 specifier such as ``">=2.5,<2.7"``)."""
    from packaging.specifiers import SpecifierSet  # every supported framework depends on packaging
    from packaging.version import Version

    try:
        installed = version(package)
    except PackageNotFoundError:
        raise UnsupportedVersionError(f"asyncckpt's {adapter} adapter needs {package} {supported}, which is not "
                                      f"installed (pip install 'asyncckpt[{adapter}]')") from None
    if Version(installed).release and Version(Version(installed).base_version) in SpecifierSet(supported):
        return installed
    raise UnsupportedVersionError(
        f"asyncckpt's {adapter} adapter supports {package} {supported}; {package} {installed} is installed. Install a "
        f"supported version, or an asyncckpt release that supports {package} {installed}.")
