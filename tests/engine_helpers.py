"""Helpers shared by the engine and trainer tests."""

from __future__ import annotations

import asyncio
import time


async def until_decoding(eng, n: int, timeout_s: float = 60.0) -> None:
    """Wait until ``n`` requests are in ``eng``'s decode batch. Requests started with
    ``ensure_future`` before ``await eng.generate(other)`` are submitted after ``other`` (the
    awaited coroutine runs first), and on a loaded machine they can join several steps later."""
    deadline = time.monotonic() + timeout_s
    while eng.stats()["running"] < n:
        assert time.monotonic() < deadline, f"{n} requests never started decoding"
        await asyncio.sleep(0.001)


def wait_until(pred, timeout: float = 30.0) -> bool:
    """Poll ``pred()`` every 10 ms until it is true or ``timeout`` seconds have passed; returns
    its last value (for engine threads whose state changes between two steps)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return bool(pred())
