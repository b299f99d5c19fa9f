"""LoRA adapter slots of one replica (vLLM's LRU adapter caches, GPU and host memory).

Contract:

* ``max_loras`` GPU slots. An adapter is *active* while at least one running request
  uses it; active adapters are never evicted.
* A request may start when its adapter is resident, or a slot is empty, or some resident
  adapter is idle (that one is evicted, least recently used first). Otherwise it waits —
  vLLM's scheduler skips it and tries the next waiting request.
* Loading into a slot costs ``load_host_s`` when the adapter is still in the host-memory
  LRU (``cpu_capacity`` adapters), else ``load_disk_s``; the caller adds the cost to the
  step that first runs the adapter.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["LoraSlots"]


class LoraSlots:
    __slots__ = (
        "max_loras", "cpu_capacity", "load_host_s", "load_disk_s",
        "_gpu", "_host", "_active", "loads", "disk_loads",
    )

    def __init__(
        self, max_loras: int, cpu_capacity: int, load_host_s: float, load_disk_s: float
    ) -> None:
        self.max_loras = max_loras
        self.cpu_capacity = cpu_capacity
        self.load_host_s = load_host_s
        self.load_disk_s = load_disk_s
        self._gpu: OrderedDict[str, None] = OrderedDict()
        self._host: OrderedDict[str, None] = OrderedDict()
        self._active: dict[str, int] = {}
        self.loads = 0
        """Adapters copied into a GPU slot so far."""
        self.disk_loads = 0
        """Of those, the ones that also had to come from disk."""

    @property
    def resident(self) -> tuple[str, ...]:
        """Adapters in GPU slots, least recently used first."""
        return tuple(self._gpu)

    def is_resident(self, adapter: str) -> bool:
        return adapter in self._gpu

    def can_start(self, adapter: str) -> bool:
        """Whether a request for ``adapter`` could join the batch now."""
        if adapter in self._gpu or len(self._gpu) < self.max_loras:
            return True
        return any(a not in self._active for a in self._gpu)

    def acquire(self, adapter: str) -> float:
        """Mark one more running request on ``adapter``; return the load time it costs.

        Raises ``RuntimeError`` when :meth:`can_start` is false (a scheduler bug).
        """
        load = 0.0
        if adapter not in self._gpu:
            if len(self._gpu) >= self.max_loras:
                victim = next((a for a in self._gpu if a not in self._active), None)
                if victim is None:
                    raise RuntimeError(f"no LoRA slot for {adapter!r}: all {self.max_loras} busy")
                del self._gpu[victim]
            if adapter in self._host:
                load = self.load_host_s
            else:
                load = self.load_disk_s
                self.disk_loads += 1
                self._host[adapter] = None
                if len(self._host) > self.cpu_capacity:
                    self._host.popitem(last=False)
            self._host.move_to_end(adapter)
            self._gpu[adapter] = None
            self.loads += 1
        self._gpu.move_to_end(adapter)
        self._active[adapter] = self._active.get(adapter, 0) + 1
        return load

    def release(self, adapter: str) -> None:
        """One running request on ``adapter`` left the batch (finished or preempted)."""
        n = self._active[adapter] - 1
        if n:
            self._active[adapter] = n
        else:
            del self._active[adapter]
