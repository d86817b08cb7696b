"""The adapters an engine serves, by name, and their host copies: at most max_cpu_loras are kept in host memory
(least recently used dropped first); a dropped one is read from its directory again when a request needs it.

Each registration gets a new id, so a name re-added with other weights never shares a device slot or a prefix-cache
block with the old ones."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.lora.adapter import LoRAAdapter

_ids = itertools.count(1)


@dataclass(eq=False)
class AdapterEntry:
    name: str
    path: str
    rank: int
    id: int = field(default_factory=lambda: next(_ids))
    host: LoRAAdapter | None = None  # None when dropped from host memory


class LoRARegistry:
    def __init__(self, max_cpu_loras: int | None, reload: Callable[[str, str], LoRAAdapter]) -> None:
        self.max_cpu_loras = max_cpu_loras
        self._reload = reload  # (path, name) -> the adapter on the host, as first loaded
        self._by_name: dict[str, AdapterEntry] = {}
        self._on_host: OrderedDict[int, AdapterEntry] = OrderedDict()
        self.num_disk_loads = 0

    def add(self, adapter: LoRAAdapter) -> AdapterEntry:
        """Registers a loaded adapter under its name, replacing any adapter of that name."""
        entry = AdapterEntry(adapter.name, adapter.path, adapter.rank, host=adapter)
        self._by_name[adapter.name] = entry
        self._keep_on_host(entry)
        return entry

    def remove(self, name: str) -> AdapterEntry | None:
        """Unregisters a name; sequences already running with it keep their entry until they finish."""
        entry = self._by_name.pop(name, None)
        if entry is not None:
            self._on_host.pop(entry.id, None)
        return entry

    def get(self, name: str) -> AdapterEntry:
        entry = self._by_name.get(name)
        if entry is None:
            known = sorted(self._by_name)
            raise ValueError(f"lora_name: unknown adapter {name!r} (this engine serves {known})")
        return entry

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def entries(self) -> list[AdapterEntry]:
        return [self._by_name[name] for name in self.names()]

    def host_copy(self, entry: AdapterEntry) -> LoRAAdapter:
        """The entry's weights in host memory, read from disk again if they were dropped."""
        if entry.host is None:
            entry.host = self._reload(entry.path, entry.name)
            self.num_disk_loads += 1
        if self._by_name.get(entry.name) is entry:  # a removed adapter's copy goes with its last sequence
            self._keep_on_host(entry)
        return entry.host

    def _keep_on_host(self, entry: AdapterEntry) -> None:
        self._on_host[entry.id] = entry
        self._on_host.move_to_end(entry.id)
        while self.max_cpu_loras is not None and len(self._on_host) > self.max_cpu_loras:
            _, dropped = self._on_host.popitem(last=False)
            dropped.host = None
