"""LoadAdapter calls naming one adapter run one at a time (AdapterResolver._load_lock), also when a
call arrives just as the holder leaves and a waiter has been woken but has not yet run: with the
lock dropped from the table at that moment, the newcomer made a fresh lock and ran beside the
waiter, and one call reported the other's version
(test_concurrent_loads_of_one_name_each_report_their_own, which caught it once in a CI run)."""

import asyncio

from loraplex.services.inference.adapter_resolver import AdapterResolver


def test_a_caller_arriving_at_release_waits_for_the_woken_waiter():
    async def scenario() -> tuple[int, list[str], int]:
        resolver = AdapterResolver(engine=None, store=None, metrics=None)
        inside, peak, order = 0, 0, []
        leave_a = asyncio.Event()

        async def load(tag: str, gate: asyncio.Event | None = None) -> None:
            nonlocal inside, peak
            async with resolver._load_lock("contested"):
                inside += 1
                peak = max(peak, inside)
                order.append(tag)
                if gate is not None:
                    await gate.wait()  # and leave at once when it opens
                else:
                    for _ in range(3):  # stay inside across several loop turns
                        await asyncio.sleep(0)
                inside -= 1

        a = asyncio.create_task(load("a", leave_a))
        await asyncio.sleep(0)  # a holds the lock
        b = asyncio.create_task(load("b"))
        await asyncio.sleep(0)  # b waits for it
        leave_a.set()  # a runs next turn: it releases, b is woken but runs only after c's first step
        c = asyncio.create_task(load("c"))
        await asyncio.gather(a, b, c)
        return peak, order, len(resolver._load_locks)

    peak, order, left = asyncio.run(scenario())
    assert peak == 1, f"two loads of one name ran at once (order {order})"
    assert order == ["a", "b", "c"]
    assert left == 0  # the table forgets the name once nobody holds or waits for it


def test_loads_of_different_names_do_not_wait_for_each_other():
    async def scenario() -> int:
        resolver = AdapterResolver(engine=None, store=None, metrics=None)
        inside, peak = 0, 0
        release = asyncio.Event()

        async def load(name: str) -> None:
            nonlocal inside, peak
            async with resolver._load_lock(name):
                inside += 1
                peak = max(peak, inside)
                await release.wait()
                inside -= 1

        tasks = [asyncio.create_task(load(n)) for n in ("a", "b", "c")]
        for _ in range(3):
            await asyncio.sleep(0)
        release.set()
        await asyncio.gather(*tasks)
        assert not resolver._load_locks
        return peak

    assert asyncio.run(scenario()) == 3
