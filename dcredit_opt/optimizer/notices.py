"""Notices said once: a warning per optimizer and reason, logged the first time it applies."""

from __future__ import annotations

import logging

log = logging.getLogger("dcredit_opt")


class Notices:
    """The reasons already told (``"python path"``, ``"rows"``, ...): each is logged once per optimizer."""

    __slots__ = ("_told",)

    def __init__(self):
        self._told: set = set()

    def tell(self, key: str, message: str) -> None:
        if key not in self._told:
            self._told.add(key)
            log.warning("%s", message)

    def __contains__(self, key) -> bool:
        return key in self._told

    def __iter__(self):
        return iter(self._told)
