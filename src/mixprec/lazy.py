"""Public names that load on first use (PEP 562): importing a package costs nothing until a name is used,
so ``import mixprec`` and the ``mixprec`` command's ``--help`` do not pay for importing torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping

__all__ = ["lazy_names"]


def lazy_names(
    package: str, namespace: dict[str, object], sources: Mapping[str, str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__`` for ``sources`` (public name -> module holding it; a name
    equal to the module's last component is that module itself)."""

    def __getattr__(name: str) -> object:
        source = sources.get(name)
        if source is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(source)
        value = module if source.rsplit(".", 1)[-1] == name else getattr(module, name)
        namespace[name] = value  # once loaded, an ordinary attribute
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *sources})

    return __getattr__, __dir__
