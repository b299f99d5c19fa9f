"""`epick bench real`'s adapter-load estimate: each replica's slots as an LRU in send order."""

from epick.bench.real import AdapterSlots


def test_first_use_of_each_adapter_on_a_replica_is_a_load():
    slots = AdapterSlots(2)
    for address, adapter in [("a", "x"), ("b", "x"), ("a", "y"), ("a", "x"), ("b", "x")]:
        slots.send(address, adapter)
    assert slots.loads == 3  # a:x, b:x, a:y; the repeats are resident


def test_a_third_adapter_evicts_the_least_recently_sent():
    slots = AdapterSlots(2)
    for adapter in ["x", "y", "x", "z", "x", "y"]:
        slots.send("a", adapter)
    # x, y load; x hits; z evicts y (x was used more recently); x hits; y evicts z.
    assert slots.loads == 4
    assert slots.held["a"] == ["x", "y"]


def test_affinity_loads_fewer_than_alternation():
    affine, spread = AdapterSlots(2), AdapterSlots(2)
    sequence = ["w", "x", "y"] * 10
    for k, adapter in enumerate(sequence):
        affine.send("a" if adapter in "wx" else "b", adapter)
        spread.send("ab"[k % 2], adapter)  # each replica cycles through 3 adapters in 2 slots
    assert affine.loads == 3
    assert spread.loads == 30
