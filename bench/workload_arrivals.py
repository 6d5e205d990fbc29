"""The open-loop workload's load: what arrives and when, and the driver that sends it.

A `Scenario` (parsed from its name) says how many adapters there are, how popular each is and the
server's slot flags; `make_arrivals` draws one seeded list of arrival times, lengths, prompts and
popularity draws that every scenario replays; `drive` sends each arrival at its time on its own
task (open loop: a slow answer never delays the next arrival) and records what comes back.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np

from loraplex.bench.workload_targets import Target

HOT_ADAPTERS = 8  # the report's "hot" TTFT: requests of the S most popular Zipf adapters, S = K, P or this


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds after the window opens
    prompt_ids: list[int]
    max_new_tokens: int
    draw: float  # uniform in [0, 1): picks the adapter, the same draw in every scenario


@dataclass(frozen=True)
class Scenario:
    name: str
    popularity: str  # base | zipf | uniform
    num_adapters: int = 0
    max_loras_per_batch: int | None = None  # None: the server's default flags
    max_gpu_loras: int | None = None  # None: the server's default pool bound
    hot: int | None = None  # S of the hottest-S TTFT (None: K, else P, else HOT_ADAPTERS)

    @classmethod
    def parse(cls, text: str) -> Scenario:
        if text == "base":
            return cls("base", "base")
        parts = text.split(":")
        usage = (
            f"scenario {text!r}: use 'base' or "
            "'zipf|uniform:N[:MAX_LORAS_PER_BATCH][:pool=MAX_GPU_LORAS][:hot=S]'"
        )
        if parts[0] not in ("zipf", "uniform") or not 2 <= len(parts) <= 5:
            raise ValueError(usage)
        k = pool = hot = None
        for part in parts[2:]:
            if part.startswith("pool="):
                pool = int(part.removeprefix("pool="))
            elif part.startswith("hot="):
                hot = int(part.removeprefix("hot="))
            elif part.isdigit() and k is None:
                k = int(part)
            else:
                raise ValueError(usage)
        return cls(text, parts[0], int(parts[1]), k, pool, hot)

    @property
    def hot_count(self) -> int:
        """S: the adapters counted as hot (hot=S, else the cap, else the pool bound, else HOT_ADAPTERS)."""
        return self.hot or self.max_loras_per_batch or self.max_gpu_loras or HOT_ADAPTERS

    def adapter_index(self, draw: float, exponent: float) -> int | None:
        if self.popularity == "base":
            return None
        if self.popularity == "uniform":
            return min(int(draw * self.num_adapters), self.num_adapters - 1)
        weights = 1.0 / np.arange(1, self.num_adapters + 1) ** exponent
        cdf = np.cumsum(weights) / weights.sum()
        return int(min(np.searchsorted(cdf, draw, side="right"), self.num_adapters - 1))


def make_arrivals(
    rate: float,
    window: float,
    cv: float,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab: tuple[int, int],
    seed: int,
) -> list[Arrival]:
    """Arrival times in [0, window): exponential gaps (cv 1) or Gamma gaps with that coefficient of
    variation."""
    rng = np.random.default_rng(seed)
    out: list[Arrival] = []
    t = 0.0
    while True:
        if cv == 1.0:
            t += rng.exponential(1.0 / rate)
        else:
            shape = 1.0 / cv**2
            t += rng.gamma(shape, 1.0 / (rate * shape))
        if t >= window:
            return out
        n_prompt = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        ids = rng.integers(vocab[0], vocab[1], size=n_prompt).tolist()
        out.append(Arrival(t, ids, int(rng.integers(output_len[0], output_len[1] + 1)), float(rng.random())))


@dataclass
class Record:
    adapter: str | None
    start: float = 0.0
    token_times: list[float] = field(default_factory=list)  # one entry per streamed message ...
    token_counts: list[int] = field(default_factory=list)  # ... and how many tokens it carried
    queue_time: float | None = None  # arrival to first scheduled, as the engine measured it
    done: bool = False
    error: str | None = None


async def _one(target: Target, rid: str, arrival: Arrival, rec: Record, t0: float) -> None:
    rec.start = time.perf_counter() - t0
    try:
        async for n, queued in target.stream(rid, arrival.prompt_ids, rec.adapter, arrival.max_new_tokens):
            if queued is not None and rec.queue_time is None:
                rec.queue_time = queued
            if n:
                rec.token_times.append(time.perf_counter() - t0)
                rec.token_counts.append(n)
        rec.done = True
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # counted, not fatal: the report says how many and which
        rec.error = f"{type(exc).__name__}: {exc}"[:200]


async def drive(
    target: Target, arrivals: list[Arrival], adapters: list[str | None], window: float, drain: float
) -> tuple[list[Record], list[tuple[int, int]], float]:
    """Send every arrival at its time, sample the engine's queue, cut what is open at window + drain."""
    records = [Record(a) for a in adapters]
    samples: list[tuple[int, int]] = []
    t0 = time.perf_counter()
    tasks: list[asyncio.Task] = []

    async def sample() -> None:
        while time.perf_counter() - t0 < window:
            s = target.queue_sizes()
            if s is not None:
                samples.append(s)
            await asyncio.sleep(0.1)

    sampler = asyncio.create_task(sample())
    for i, arrival in enumerate(arrivals):
        delay = arrival.at - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_one(target, f"w{i}", arrival, records[i], t0)))
    remaining = window + drain - (time.perf_counter() - t0)
    if tasks:
        await asyncio.wait(tasks, timeout=max(remaining, 0.0))
    elapsed = time.perf_counter() - t0
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, sampler, return_exceptions=True)
    return records, samples, elapsed
