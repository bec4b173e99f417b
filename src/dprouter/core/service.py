"""``async with`` over a component's ``start`` and ``stop``: a router, the supervisor of
several serving processes, a simulated cluster."""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import TracebackType
from typing import Self


class Service(ABC):
    @abstractmethod
    async def start(self) -> None:
        """Returns once the component serves."""

    @abstractmethod
    async def stop(self) -> None:
        """Returns once it has stopped, whatever it had under way."""

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()
