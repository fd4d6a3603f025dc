"""One request's failure stays that request's. A step runs many requests' work in one pass (their
constraints, sampling knobs, verification); when a part that belongs to some requests raises, the
step is undone and done again without them, and only they fail.

Two ways to find the requests at fault:
- blame: the engine runs each request's own work (its constraint's walk and masks, its knobs'
  warpers, its sampling and verification) inside `blame(handle, ...)`, which turns any exception
  into a `RequestFault` naming them;
- isolation: an exception nobody is blamed for (a shared processor, a proposer, the forward) is
  isolated by running the step on halves of its requests, each half a real step for its requests
  (a row's tokens do not depend on the rows beside it). A request that fails alone fails; where
  every request fails alone, the failure is the model's, and the runner records it as a step failure.

A step can be undone only up to its commit: the engine decides every request's tokens before it
commits any (`Runner._rewind` restores the generators and discards the tentative KV slots), and what
fails while committing fails that request alone without undoing the others.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")


class RequestFault(Exception):
    """Work that belongs to the requests `handles` raised `cause`."""

    def __init__(self, handles: list[int], cause: BaseException):
        super().__init__(f"request {', '.join(map(str, handles))}: {type(cause).__name__}: {cause}")
        self.handles, self.cause = list(handles), cause


@contextlib.contextmanager
def blame(*handles: int) -> Iterator[None]:
    """What raises inside is the fault of these requests (a RequestFault passes through as it is)."""
    try:
        yield
    except RequestFault:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of a request's own work is that request's
        raise RequestFault(list(handles), e) from e


def isolate(items: list[T], run: Callable[[list[T]], None], rewind: Callable[[list[T]], None],
            handle: Callable[[T], int]) -> list[tuple[T, BaseException, bool]]:
    """Run `run(items)`; where it raises, `rewind(part)` undoes it and the part runs again without
    the requests at fault (blamed by a RequestFault, else found by halving). Returns the failed items
    with their causes and whether each was blamed (False: it failed alone, unexplained). Anything
    that is not an Exception (Ctrl-C) propagates."""
    failed: list[tuple[T, BaseException, bool]] = []
    todo = [list(items)]
    while todo:
        part = todo.pop()
        try:
            run(part)
        except RequestFault as f:
            rewind(part)
            bad = [x for x in part if handle(x) in f.handles]
            if not bad:  # blames nobody of this part: a bug in the blame, said as the failure it hides
                raise f.cause from f
            failed += [(x, f.cause, True) for x in bad]
            rest = [x for x in part if handle(x) not in f.handles]
            if rest:
                todo.append(rest)
        except Exception as e:  # noqa: BLE001 - unexplained: halve until it is explained
            rewind(part)
            if len(part) == 1:
                failed.append((part[0], e, False))
            else:
                half = len(part) // 2
                todo += [part[half:], part[:half]]  # the first half runs first
    return failed
