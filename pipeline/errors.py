"""User-facing errors: one line naming what was wrong and how to fix it, never a traceback."""
from __future__ import annotations

import functools
import sys

from pipeline.core.errors import UserError

__all__ = ["Interrupted", "UserError", "one_line_errors"]


class Interrupted(UserError):
    """Ctrl-C / SIGTERM after what finished was saved: one line, exit code 130."""
    exit_code = 130


def one_line_errors(fn):
    """Wrap an entry point: a UserError (or a ValueError raised by a component's constructor
    validation) becomes `error: <message>` on stderr and exit code 2."""
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except Interrupted as e:
            _die(str(e), e.exit_code, prefix="")
        except UserError as e:
            _die(str(e))
        except KeyboardInterrupt:
            _die("interrupted before any request finished: nothing new was written", 130, prefix="")
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


def _die(msg: str, code: int = 2, prefix: str = "error: "):
    print(f"{prefix}{' '.join(msg.split())}", file=sys.stderr)
    sys.exit(code)
