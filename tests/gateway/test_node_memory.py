"""The node's memory record and the choice of the sleeper to push down before a wake (gateway/serving/node_memory.py),
without Ray: the record as a plain object, push-downs as a function that changes the victim's line as its replica
would. The same code on real Ray Serve: test_serve.py::test_a_wake_that_needs_memory_pushes_the_least_recently_used_sleeper_down."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray")

from gateway.serving.node_memory import (  # noqa: E402
    CPU,
    GIB,
    NodeMemory,
    NoRoomToWake,
    ReplicaMemory,
    choose_push_down,
    make_room,
    replica_memory,
)

MIB = 2**20
W, K = 500 * MIB, 200 * MIB  # each model's weights and KV pool: awake 700 MiB, asleep at level 1 500, at level 2 0


def line(name: str, level: int, last_used: float, device: str = CPU, held: int | None = None) -> ReplicaMemory:
    if held is None:
        held = {0: W + K, 1: W, 2: 0}[level]
    return ReplicaMemory(name, f"r-{name}", device, W + K, held, level, last_used)


def test_the_least_recently_used_level_1_sleeper_is_chosen_never_an_awake_one():
    records = [line("awake-oldest", 0, 1.0), line("b", 1, 20.0), line("a", 1, 10.0), line("deep", 2, 2.0),
               line("other-gpu", 1, 0.5, device="gpu:1", held=10), line("empty", 1, 3.0, held=0),
               line("waker", 1, 0.1)]
    assert choose_push_down(records, "r-waker", CPU).model == "a"
    assert choose_push_down(records, "r-waker", CPU, skip={"r-a"}).model == "b"
    assert choose_push_down(records, "r-waker", CPU, skip={"r-a", "r-b"}) is None  # awake, level 2, empty: never
    assert choose_push_down(records, "r-x", "gpu:1").model == "other-gpu"
    assert choose_push_down([line("awake", 0, 0.0)], "r-waker", CPU) is None


def _pushes(ledger: NodeMemory, pushed: list[str], answer: dict[str, bool | None] | None = None):
    """A push-down as the victim's replica does it: level 2, its host copy dropped, reported to the record."""

    async def push(victim: ReplicaMemory) -> bool | None:
        outcome = (answer or {}).get(victim.model, True)
        if outcome:
            ledger.report(ReplicaMemory(victim.model, victim.replica, victim.device, victim.awake_bytes, 0, 2,
                                        victim.last_used, push_downs=victim.push_downs + 1))
            pushed.append(victim.model)
        return outcome

    return push


def _call(ledger: NodeMemory):
    async def call(method: str, *args):
        return getattr(ledger, method)(*args)

    return call


def _wake(ledger: NodeMemory, waker: ReplicaMemory, budget: int | None = None, free=None,
          answer: dict[str, bool | None] | None = None) -> list[str]:
    pushed: list[str] = []
    async def main():
        await make_room(_call(ledger), waker, budget_bytes=budget, measure_free=free,
                        push=_pushes(ledger, pushed, answer))

    asyncio.run(main())
    return pushed


def test_a_wake_pushes_the_least_recently_used_sleepers_down_until_it_fits_and_no_others():
    ledger = NodeMemory()
    for name, used in (("a", 1.0), ("b", 2.0), ("c", 3.0), ("d", 4.0)):
        ledger.report(line(name, 1, used))
    # d wakes: the others hold 3 * 500 MiB; it needs 700 of 1300: two pushes (a, then b) leave 500 + 700
    assert _wake(ledger, line("d", 1, 4.0), budget=1300 * MIB) == ["a", "b"]
    assert {r.model: r.level for r in ledger.records()} == {"a": 2, "b": 2, "c": 1, "d": 1}
    # until its wake is done d is promised its 700 MiB, and is no sleeper to push: c's wake finds no room
    with pytest.raises(NoRoomToWake, match="no sleeping model left to push down"):
        _wake(ledger, line("c", 1, 3.0), budget=1300 * MIB)
    ledger.done_waking("r-d")
    ledger.report(line("d", 0, 4.0))
    with pytest.raises(NoRoomToWake, match=r"\(awake: d\)"):
        _wake(ledger, line("c", 1, 3.0), budget=1300 * MIB)
    assert {r.model: r.level for r in ledger.records()} == {"a": 2, "b": 2, "c": 1, "d": 0}


def test_a_wake_that_fits_pushes_nothing():
    ledger = NodeMemory()
    ledger.report(line("a", 1, 1.0))
    assert _wake(ledger, line("b", 1, 2.0), budget=1200 * MIB) == []  # 500 + 700
    assert {r.model: r.level for r in ledger.records()} == {"a": 1, "b": 1}


def test_with_nothing_left_to_push_the_wake_is_refused_naming_the_shortfall():
    ledger = NodeMemory()
    ledger.report(line("a", 0, 1.0))
    ledger.report(line("b", 2, 0.5))  # at level 2: nothing left to drop
    with pytest.raises(NoRoomToWake) as e:
        _wake(ledger, line("c", 1, 2.0), budget=1000 * MIB)
    message = str(e.value)
    assert "it needs 0.684 GiB and 0.292 GiB is left of this node's" in message  # 700 MiB up, 300 MiB down
    assert "no sleeping model left to push down (awake: a)" in message
    assert [r.level for r in ledger.records() if r.model == "a"] == [0]  # the awake one was not touched


def test_a_wake_that_pushing_every_sleeper_could_not_fit_pushes_none():
    ledger = NodeMemory()
    ledger.report(line("awake", 0, 3.0))
    ledger.report(line("old", 1, 1.0))
    # w needs 700 MiB; the budget leaves 1350 - 700 - 500 = 150 and pushing `old` frees 500 more: still short
    with pytest.raises(NoRoomToWake) as e:
        _wake(ledger, line("w", 1, 9.0), budget=1350 * MIB)
    assert "pushing every sleeping model down would free only 0.488 GiB (awake: awake)" in str(e.value)
    assert {r.model: r.level for r in ledger.records()} == {"awake": 0, "old": 1, "w": 1}  # nothing pushed


def test_a_sleeper_that_turns_busy_or_is_gone_is_skipped_and_the_next_one_pushed():
    ledger = NodeMemory()
    for name, used in (("busy", 1.0), ("gone", 2.0), ("next", 3.0)):
        ledger.report(line(name, 1, used))
    assert _wake(ledger, line("w", 1, 9.0), budget=1300 * MIB, answer={"busy": False, "gone": None}) == ["next"]
    assert {r.model for r in ledger.records()} == {"busy", "next", "w"}  # the gone one's line was dropped


def test_on_a_gpu_the_free_memory_decides_and_a_sleeper_holding_none_of_it_is_not_pushed():
    ledger = NodeMemory()
    gpu = "gpu:0"
    ledger.report(line("holds", 1, 1.0, device=gpu, held=300 * MIB))  # still reserves device memory asleep
    ledger.report(line("empty", 1, 0.5, device=gpu, held=0))  # gave it all back: pushing it frees nothing
    free = [500 * MIB]

    async def measure() -> int:
        return free[0]

    async def push(victim: ReplicaMemory) -> bool:
        free[0] += victim.held_bytes
        ledger.report(ReplicaMemory(victim.model, victim.replica, gpu, victim.awake_bytes, 0, 2, victim.last_used))
        return True

    async def main(waker: ReplicaMemory) -> list[str]:
        return [v.model for v in await make_room(_call(ledger), waker, budget_bytes=None, measure_free=measure,
                                                 push=push)]

    assert asyncio.run(main(line("w", 1, 9.0, device=gpu, held=0))) == ["holds"]  # 500 + 300 >= 700
    free[0] = 100 * MIB  # another model took the GPU meanwhile: nothing holds memory there any more
    with pytest.raises(NoRoomToWake, match="free on gpu:0"):
        asyncio.run(main(line("x", 1, 9.5, device=gpu, held=0)))


def test_a_line_not_refreshed_no_longer_counts():
    now = [100.0]
    ledger = NodeMemory(clock=lambda: now[0])
    ledger.report(line("a", 0, 1.0))
    now[0] += 31.0
    assert ledger.records() == []
    assert _wake(ledger, line("b", 1, 2.0), budget=800 * MIB) == []


def test_a_replicas_line_comes_from_its_engine_stats():
    stats = {"weights_bytes": W, "kv_cache_bytes": K, "host_copy_bytes": 0, "sleep_level": 0}
    assert replica_memory("m", "r", CPU, stats, 1.0).held_bytes == W + K
    assert replica_memory("m", "r", CPU, {**stats, "sleep_level": 1, "host_copy_bytes": W}, 1.0).held_bytes == W
    assert replica_memory("m", "r", CPU, {**stats, "sleep_level": 2}, 1.0).held_bytes == 0
    on_gpu = replica_memory("m", "r", "gpu:0", {**stats, "sleep_level": 1, "host_copy_bytes": W,
                                                "device_reserved_bytes": 20 * MIB}, 1.0)
    assert (on_gpu.awake_bytes, on_gpu.held_bytes, on_gpu.host_bytes) == (W + K, 20 * MIB, W)


def test_the_budget_setting_reaches_the_replicas_of_chat_models_only():
    from gateway.serving.model_app import model_application
    from gateway.settings import Settings
    from gateway.specs import parse_spec

    spec = parse_spec({"name": "m", "source": "random:llama-tiny"})
    plain = model_application(spec, Settings())._bound_deployment
    bounded = model_application(spec, Settings(node_memory_budget_gib=2.5))._bound_deployment
    assert "node_memory_budget_gib" not in plain.init_kwargs
    assert bounded.init_kwargs == {"node_memory_budget_gib": 2.5} and bounded.version != plain.version


class _Backend:
    """Just what ModelServer's wake and push-down paths use of a LocalEngineBackend."""

    def __init__(self, level: int) -> None:
        self.sleep_level, self.woke, self.slept = level, 0, []

    def stats(self) -> dict:
        return {"sleep_level": self.sleep_level, "weights_bytes": W, "kv_cache_bytes": K,
                "host_copy_bytes": W if self.sleep_level == 1 else 0}

    async def wake(self) -> float:
        self.sleep_level, self.woke = 0, self.woke + 1
        return 0.1

    async def sleep(self, level: int) -> int:
        self.slept.append(level)
        self.sleep_level = level
        return level

    async def generate(self, request):  # noqa: ANN001
        yield "token"

    def stop(self) -> None:
        pass


class _Memory:
    def __init__(self, refuse: str | None = None) -> None:
        self.refuse, self.push_downs, self.device, self.reported = refuse, 0, CPU, []
        self.bounded = True

    async def make_room(self, stats, last_used, measure_free):  # noqa: ANN001
        if self.refuse:
            raise NoRoomToWake(self.refuse)
        return []

    async def done_waking(self) -> None:
        pass

    def report(self, stats, last_used) -> None:  # noqa: ANN001
        self.reported.append(stats["sleep_level"])

    async def report_now(self, stats, last_used) -> None:  # noqa: ANN001
        self.report(stats, last_used)

    def close(self) -> None:
        pass


def _server(level: int, memory: _Memory):
    from gateway.serving.replica import ModelServer
    from gateway.specs import parse_spec

    server = ModelServer.func_or_class.__new__(ModelServer.func_or_class)
    server.spec, server.replica, server.backend, server.memory = parse_spec({"name": "m", "source": "x"}), "r-1", \
        _Backend(level), memory
    server.ready_at = server.started_at = 0.0
    server.ongoing, server.wakes, server.last_active, server.last_used = 0, 0, 0.0, 0.0
    server._sleep_lock = asyncio.Lock()
    return server


async def _served(server) -> list:  # noqa: ANN001
    return [item async for item in server.generate(object())]


def test_a_wake_with_no_room_is_refused_as_unavailable_and_the_engine_stays_asleep():
    """The replica's refusal reaches the gateway as BackendUnavailable: a 503 with Retry-After (PlatformHeaders)."""
    from gateway.serving.ray_backend import ReplicaAccepted, ReplicaError

    server = _server(1, _Memory(refuse="it needs 0.68 GiB and 0.29 GiB is left, with no sleeping model left"))
    accepted, refused = asyncio.run(_served(server))
    assert isinstance(accepted, ReplicaAccepted) and isinstance(refused, ReplicaError)
    assert refused.kind == "unavailable"
    assert refused.message == ("The model `m` could not wake: it needs 0.68 GiB and 0.29 GiB is left, with no "
                               "sleeping model left")
    assert server.backend.sleep_level == 1 and server.backend.woke == 0 and server.ongoing == 0

    server = _server(1, _Memory())
    items = asyncio.run(_served(server))
    assert items[0].woke_s is not None and items[1:] == ["token"] and server.backend.woke == 1
    assert server.memory.reported == [0]


def test_a_push_down_is_answered_by_the_replica_named_and_only_from_level_1_when_idle():
    server = _server(1, _Memory())
    assert asyncio.run(server.push_down("r-other", "w")) is None  # a broadcast: not this one
    server.ongoing = 1
    assert asyncio.run(server.push_down("r-1", "w")) is False  # a request is running or waiting for it
    server.ongoing = 0
    assert asyncio.run(server.push_down("r-1", "w")) is True
    assert server.backend.slept == [2] and server.memory.push_downs == 1 and server.memory.reported == [2]
    assert asyncio.run(server.push_down("r-1", "w")) is False  # at level 2 already
    awake = _server(0, _Memory())
    assert asyncio.run(awake.push_down("r-1", "w")) is False and awake.backend.slept == []
