"""What a block of code leaves in reference cycles: objects only Python's cyclic collector frees
(tests/test_reference_cycles.py says why a call must leave none; tools/host_time.py --gc counts
them a call)."""

import collections
import gc


def left_in_cycles(call, calls: int = 1) -> list:
    """The objects `calls` calls of `call` leave to Python's cyclic collector (what it would free,
    kept by gc.DEBUG_SAVEALL instead)."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(calls):
            call()
        gc.collect()
    finally:
        gc.set_debug(0)
    found = list(gc.garbage)
    gc.garbage.clear()
    return found


def kinds(objects) -> list:
    """(type, count) of the most frequent types among `objects`, for a failure's message."""
    return collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in objects).most_common(12)
