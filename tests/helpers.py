"""Small helpers shared by the multi-process tests."""
import time


def wait_for(predicate, timeout=90.0, period=0.25, what="condition"):
    """Poll ``predicate`` until it returns something truthy (returned) or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(period)
    raise TimeoutError(f"timed out waiting for {what}")
