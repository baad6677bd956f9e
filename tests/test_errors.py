"""Every exception class the package defines derives from DataStatesError, and still from the built-in
class callers caught before (ValueError, RuntimeError, OSError, ImportError): found by reading every
module's source, so that a class added later without the base fails here."""

import ast
import importlib
import pickle
from pathlib import Path

import nanotron_datastates
from nanotron_datastates import DataStatesError
from nanotron_datastates.errors import ChecksumError, FormatError

PACKAGE = Path(nanotron_datastates.__file__).parent
BUILTIN = (ValueError, RuntimeError, OSError, ImportError, pickle.UnpicklingError)


def exception_classes() -> list[tuple[str, str]]:
    """(module, class) of every class whose bases name an exception, in every module of the package."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names = [ast.unparse(b) for b in node.bases]
                if any(n.endswith(("Error", "Exception")) for n in names):
                    out.append((module.removesuffix(".__init__"), node.name))
    return out


def test_every_exception_of_the_package_is_a_datastates_error_and_keeps_its_builtin_base():
    found = exception_classes()
    assert len(found) >= 12, found  # the classes known when this test was written
    for module, name in found:
        cls = getattr(importlib.import_module(module), name)
        assert issubclass(cls, DataStatesError), f"{module}.{name}"
        assert cls is DataStatesError or issubclass(cls, BUILTIN), f"{module}.{name} lost its built-in base"


def test_one_except_clause_catches_any_of_them():
    from nanotron_datastates.trust import UntrustedPath

    for error in (FormatError("f"), ChecksumError("c"), UntrustedPath(1, "not ours", "/x")):
        try:
            raise error
        except DataStatesError as caught:
            assert caught is error
    assert UntrustedPath(1, "not ours", "/x").filename == "/x"  # an OSError still, with its path
