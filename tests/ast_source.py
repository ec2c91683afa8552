"""`ast.parse` for the tests that read the repository's own code, retried on CPython's spurious
`SystemError: AST constructor recursion depth mismatch`.

The AST constructor's recursion counter is per interpreter (python/cpython#106905, fixed by #106906): when
another thread converts an AST at the same time (numpy's `literal_eval` of an .npz header in a server a
test left running, a dataclass being built) and the GIL switches mid-conversion, the check fails for a
parse that is fine. The suite saw it once beside two busy loops (tests/test_layers.py, Python 3.11.7). A
parse that fails so is repeated; a real syntax error still raises at once.
"""

from __future__ import annotations

import ast

ATTEMPTS = 5


def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    """ast.parse(source, filename), repeated on the interpreter's spurious recursion-depth SystemError."""
    for attempt in range(ATTEMPTS):
        try:
            return ast.parse(source, filename)
        except SystemError as err:
            if "recursion depth mismatch" not in str(err) or attempt == ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")
