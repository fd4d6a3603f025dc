"""User-facing errors: one line naming what was wrong and how to fix it, never a traceback.
Torch-free; `pipeline.core` re-exports `UserError` for the components."""
from __future__ import annotations

import functools
import sys
from typing import NoReturn

__all__ = ["Interrupted", "UserError", "die", "one_line_errors", "positive_int"]


class UserError(ValueError):
    """Bad input (config, files, prompts). The entry points print it on one line and exit 2. A
    ValueError, as a constructor's validation error is: what catches one catches the other."""


class Interrupted(UserError):
    """Ctrl-C / SIGTERM after what finished was saved: one line, exit code 130."""
    exit_code = 130


def positive_int(value, name: str) -> int:
    """`value` when it is a positive int (a bool is not), else a UserError naming `name`: the one
    check behind every count a user sets (max_new_tokens, batch_size, tree.depth, heads.num_heads ...)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UserError(f"{name} must be a positive int, got {value!r}")
    return value


def die(msg: str, code: int = 2, prefix: str = "error: ") -> NoReturn:
    """End the process: `msg` on one stderr line (its whitespace collapsed), exit `code`."""
    print(f"{prefix}{' '.join(msg.split())}", file=sys.stderr)
    sys.exit(code)


def one_line_errors(fn):
    """Wrap an entry point: a UserError (or a ValueError raised by a component's constructor
    validation) becomes `error: <message>` on stderr and exit code 2."""
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except Interrupted as e:
            die(str(e), e.exit_code, prefix="")
        except UserError as e:
            die(str(e))
        except KeyboardInterrupt:
            die("interrupted before any request finished: nothing new was written", 130, prefix="")
        except Exception as e:  # Hydra wraps constructor errors in InstantiationException
            root = e
            while root.__cause__ is not None or root.__context__ is not None:
                if isinstance(root, (UserError, ValueError)):
                    break
                root = root.__cause__ or root.__context__
            if isinstance(root, (UserError, ValueError)):
                die(str(root))
            raise
    return wrapper
