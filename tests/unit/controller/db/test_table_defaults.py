"""Every default factory of a table row has a signature that Python can read without parsing text.

SQLModel asks pydantic, for each row it builds, whether a field's default factory takes the validated
data; pydantic calls ``inspect.signature``, and for a builtin such as ``list`` that parses the builtin's
text signature with ``ast.parse``, in whichever controller thread builds the row. On CPython 3.11.7 two
threads in ``ast.parse`` at once can fail one of them with a SystemError, so a row built beside any
other parse (a test's, a library's) could fail at random.
"""

from __future__ import annotations

from sqlmodel import SQLModel

import controller.db.tables  # noqa: F401  (registers every table)


def _tables() -> list[type[SQLModel]]:
    out: list[type[SQLModel]] = []
    todo = list(SQLModel.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if getattr(cls, "__table__", None) is not None and cls.__module__.startswith("controller."):
            out.append(cls)
    return out


def test_no_table_default_factory_needs_its_signature_parsed() -> None:
    tables = _tables()
    assert len(tables) >= 10, tables
    parsed = []
    for table in tables:
        for name, field in table.model_fields.items():
            factory = field.default_factory
            # A builtin with a text signature is what inspect.signature parses; a Python function's
            # signature comes from its code, and a builtin without one is refused without a parse.
            if factory is not None and getattr(factory, "__text_signature__", None) is not None:
                parsed.append(f"{table.__name__}.{name}: {factory!r}")
    assert not parsed, parsed
