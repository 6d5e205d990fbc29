"""Following the adapter store's events: `watch(client, on_event)` runs for the server's life.

It subscribes to `WatchAdapters`, lists the store once (the names it has, kept in
`client.known_names` for the residency metrics), hands each event on, and reconnects with
backoff from the last event seen. When the store says its stream no longer holds every event
since then (a `resync` event: it keeps only the latest ~10,000, `--events-max-len`), the
adapters are listed again and the differences handed on as events, so a replica cut off for
long misses no delete or replacement.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

from loraplex.services.inference.errors import LoraplexError
from loraplex.services.inference.store_client import StoreClient

log = logging.getLogger(__name__)
# on_event(type, name, digest, config_digest, files_digest); type "registered" or "deleted"
OnEvent = Callable[[str, str, str, str, str], Awaitable[None]]


async def watch(client: StoreClient, on_event: OnEvent) -> None:
    """Follow store events forever, calling `on_event` for each; reconnects with backoff."""
    last_id = ""
    backoff = 0.5
    while True:
        try:
            stream = client.open_watch(last_id)
            if not last_id:
                # Subscribed first (headers come once it is), listed second: an event racing the
                # listing is applied after it, and events are idempotent on a set.
                await stream.initial_metadata()
                client.known_names = {r.name for r in await client.list()}
            async for event in stream:
                backoff = 0.5
                if event.type == "resync":
                    await _resync(client, on_event, last_id)
                    last_id = event.id or last_id  # only once re-listed: a failed listing retries
                    continue
                last_id = event.id or last_id
                if event.type == "registered":
                    client.known_names.add(event.name)
                elif event.type == "deleted":
                    client.known_names.discard(event.name)
                await on_event(event.type, event.name, event.digest, event.config_digest, event.files_digest)
        except asyncio.CancelledError:
            raise
        except LoraplexError as err:  # the listing after (re)connecting failed
            log.warning("listing the store %s failed: %s; reconnecting in %.1fs", client.target, err, backoff)
        except grpc.RpcError as err:
            log.warning(
                "WatchAdapters on %s: %s (%s); reconnecting in %.1fs",
                client.target,
                err.code().name,
                err.details(),
                backoff,
            )
        except Exception:
            log.exception("WatchAdapters handler failed; reconnecting")
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, 10.0)


async def _resync(client: StoreClient, on_event: OnEvent, since: str) -> None:
    """The store no longer holds every event since `since`: list what it has now and hand on the
    differences as events - "deleted" for each name known here (listed, seen in an event, or
    pulled) that it no longer has, "registered" for each it has (the handler ignores content it
    already serves)."""
    records = await client.list()
    listed = {r.name for r in records}
    gone = sorted(client.known_names - listed)
    log.warning(
        "WatchAdapters on %s: events since %s are gone from the store's stream; re-listed %d "
        "adapters (%d gone meanwhile)",
        client.target,
        since,
        len(records),
        len(gone),
    )
    client.known_names = listed
    for name in gone:
        await on_event("deleted", name, "", "", "")
    for r in records:
        await on_event("registered", r.name, r.digest, r.config_digest, r.files_digest)
