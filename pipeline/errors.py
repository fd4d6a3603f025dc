"""User-facing errors: one line naming what was wrong and how to fix it, never a traceback."""
from __future__ import annotations

import functools
import sys


class UserError(Exception):
    """Bad input (config, files, prompts). The entry points print it on one line and exit 2."""


def one_line_errors(fn):
    """Wrap an entry point: a UserError (or a ValueError raised by a component's constructor
    validation) becomes `error: <message>` on stderr and exit code 2."""
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except UserError as e:
            _die(str(e))
        except Exception as e:  # Hydra wraps constructor errors in InstantiationException
            root = e
            while root.__cause__ is not None or root.__context__ is not None:
                if isinstance(root, (UserError, ValueError)):
                    break
                root = root.__cause__ or root.__context__
            if isinstance(root, (UserError, ValueError)):
                _die(str(root))
            raise
    return wrapper


def _die(msg: str):
    print(f"error: {' '.join(msg.split())}", file=sys.stderr)
    sys.exit(2)
