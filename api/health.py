"""Cheap Redis health for the request path."""

from __future__ import annotations

import threading
import time
from typing import Any

from api.errors import unavailable


class RedisHealth:
    """Refuse submissions (503) while Redis is down, without pinging on every request: a failed ping is
    remembered for one second, a good one for five."""

    def __init__(self) -> None:
        self._until = 0.0
        self._ok = True
        self._error = ""
        self._lock = threading.Lock()

    def check(self, client: Any) -> None:
        now = time.monotonic()
        if now >= self._until:
            with self._lock:
                if now >= self._until:
                    try:
                        client.ping()
                        self._ok, self._until = True, now + 5.0
                    except Exception as exc:
                        self._ok, self._error, self._until = False, str(exc)[:300], now + 1.0
        if not self._ok:
            raise unavailable(f"redis unavailable: {self._error}")

    def failed(self, error: str) -> None:
        self._ok, self._error, self._until = False, error[:300], time.monotonic() + 1.0
