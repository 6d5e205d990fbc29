"""The open-loop workload's report: each scenario's records summarized (throughput inside the
window, TTFT / inter-token / end-to-end percentiles, the hot and other adapters' TTFT, queue time by
popularity decile, swaps), ratios to the `base` scenario, and the markdown tables printed."""

from __future__ import annotations

import numpy as np

from loraplex.bench.workload_arrivals import HOT_ADAPTERS, Record

DECILES = 10


def _pcts(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    p = np.percentile(values, [50, 90, 99]) * 1000
    return {"p50": round(float(p[0]), 1), "p90": round(float(p[1]), 1), "p99": round(float(p[2]), 1)}


def summarize(
    records: list[Record],
    samples: list[tuple[int, int]],
    window: float,
    counters: dict,
    ranks: dict[str, int] | None = None,
    hot_count: int = HOT_ADAPTERS,
    elapsed: float | None = None,
) -> dict:
    """`ranks`: adapter name -> popularity rank (0 = most popular), for the hot / other / decile splits."""
    ranks = ranks or {}
    ttft, hot_ttft, other_ttft, itl, e2e, tokens_in_window = [], [], [], [], [], 0
    deciles: list[list[float]] = [[] for _ in range(DECILES)]
    for r in records:
        rank = ranks.get(r.adapter) if r.adapter is not None else None
        if r.token_times:
            ttft.append(r.token_times[0] - r.start)
            if rank is not None:
                (hot_ttft if rank < hot_count else other_ttft).append(ttft[-1])
        if rank is not None and r.queue_time is not None:
            deciles[rank * DECILES // len(ranks)].append(r.queue_time)
        last = None
        for t, n in zip(r.token_times, r.token_counts, strict=True):
            if t <= window:
                tokens_in_window += n
            if last is not None:  # a message may carry several tokens: spread the gap over them
                itl.extend([(t - last) / n] * n)
            last = t
        if r.done and r.token_times:
            e2e.append(r.token_times[-1] - r.start)
    done = sum(r.done for r in records)
    errors = sum(r.error is not None for r in records)
    running = [s[0] for s in samples]
    waiting = [s[1] for s in samples]
    evictions = counters.get("evictions")
    return dict(
        requests=len(records),
        completed=done,
        errors=errors,
        cut=len(records) - done - errors,
        error_examples=sorted({r.error for r in records if r.error})[:3],
        output_tok_s=round(tokens_in_window / window, 1),
        ttft_ms=_pcts(ttft),
        itl_ms=_pcts(itl),
        e2e_ms=_pcts(e2e),
        hot_adapters=hot_count if ranks else 0,
        hot_ttft_ms=_pcts(hot_ttft),  # requests of the hot_adapters most popular adapters
        other_ttft_ms=_pcts(other_ttft),  # every other adapter's requests
        # queue time (arrival to first scheduled) of each popularity decile's requests, hottest first
        queue_ms_by_decile=[_pcts(d) for d in deciles] if ranks else [],
        swaps_per_s=round(evictions / elapsed, 2) if evictions is not None and elapsed else None,
        mean_running=round(float(np.mean(running)), 1) if running else None,
        mean_waiting=round(float(np.mean(waiting)), 1) if waiting else None,
        **counters,
    )


def add_ratios(results: dict[str, dict]) -> None:
    base = results.get("base")
    if base is None:
        return
    for res in results.values():
        ratios = {
            "output_tok_s": _ratio(res["output_tok_s"], base["output_tok_s"]),
            "mean_running": _ratio(res["mean_running"], base["mean_running"]),
        }
        ratios["hot_ttft_ms_p99"] = _ratio(res["hot_ttft_ms"]["p99"], base["ttft_ms"]["p99"])
        ratios["other_ttft_ms_p99"] = _ratio(res["other_ttft_ms"]["p99"], base["ttft_ms"]["p99"])
        for key in ("ttft_ms", "itl_ms", "e2e_ms"):
            for q in ("p50", "p90", "p99"):
                ratios[f"{key}_{q}"] = _ratio(res[key][q], base[key][q])
        res["vs_base"] = ratios


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def _fmt(v, ratio=None) -> str:
    if v is None:
        return "-"
    text = f"{v:,.0f}" if isinstance(v, float) and v >= 100 else f"{v}"
    return f"{text} ({ratio:.2f})" if ratio is not None else text


def print_table(results: dict[str, dict]) -> None:
    print(
        "| scenario | done / sent | errors | cut | output tok/s (vs base) | TTFT p50 / p99 ms | "
        "S hottest TTFT p99 ms | inter-token p50 / p99 ms | e2e p50 / p99 ms | "
        "mean running / waiting | uploads / evictions |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in results.items():
        vs = r.get("vs_base", {})
        print(
            f"| {name} | {r['completed']}/{r['requests']} | {r['errors']} | {r['cut']} "
            f"| {_fmt(r['output_tok_s'], vs.get('output_tok_s'))} "
            f"| {_fmt(r['ttft_ms']['p50'])} / {_fmt(r['ttft_ms']['p99'], vs.get('ttft_ms_p99'))} "
            f"| {_fmt(r['hot_ttft_ms']['p99'], vs.get('hot_ttft_ms_p99'))} (S={r.get('hot_adapters', 0)}) "
            f"| {_fmt(r['itl_ms']['p50'])} / {_fmt(r['itl_ms']['p99'])} "
            f"| {_fmt(r['e2e_ms']['p50'])} / {_fmt(r['e2e_ms']['p99'])} "
            f"| {_fmt(r['mean_running'])} / {_fmt(r['mean_waiting'])} "
            f"| {_fmt(r['uploads'])} / {_fmt(r['evictions'])} |"
        )


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def print_goal_table(results: dict[str, dict]) -> None:
    """Issue 34's goal table: ratios to the base scenario of the same run."""
    print(
        "\n| scenario | tok/s | TTFT p99 | S hottest TTFT p99 | others' TTFT p99 | swaps/s | uploads |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    for name, r in results.items():
        vs = r.get("vs_base", {})
        print(
            f"| {name} | {_x(vs.get('output_tok_s'))} | {_x(vs.get('ttft_ms_p99'))} "
            f"| {_x(vs.get('hot_ttft_ms_p99'))} (S={r.get('hot_adapters', 0)}) "
            f"| {_x(vs.get('other_ttft_ms_p99'))} | {_fmt(r.get('swaps_per_s'))} | {_fmt(r.get('uploads'))} |"
        )


def print_deciles(results: dict[str, dict]) -> None:
    rows = {n: r["queue_ms_by_decile"] for n, r in results.items() if r.get("queue_ms_by_decile")}
    if not rows:
        return
    print(
        "\nqueue time (arrival to first scheduled) p50 / p99 ms by adapter popularity decile, hottest first\n"
        "| scenario | " + " | ".join(f"d{i}" for i in range(DECILES)) + " |\n"
        "| --- |" + " ---: |" * DECILES
    )
    for name, deciles in rows.items():
        cells = " | ".join(f"{_fmt(d['p50'])} / {_fmt(d['p99'])}" for d in deciles)
        print(f"| {name} | {cells} |")
