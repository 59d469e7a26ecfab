"""Group commit of token batches: the syncs that arrive together share one transaction.

A sync's token batches are judged and written as before (`Ingest.accept_tokens`), but not in a
transaction of their own: each sync queues its batches and waits; the first one queued asks the
event loop for a commit at the end of the current step (`loop.call_soon`), by which time every
sync whose request was read in the same loop iteration has queued too. The commit then opens
one transaction (synchronous=NORMAL, as a lone sync's), applies each queued sync in arrival
order inside a savepoint of its own (a lone sync needs none), commits once, and only then
answers each sync: no cell hears "accepted" for tokens that are not committed. A sync whose
part raises is undone alone (its savepoint) and answered with its error; the others' parts
commit. Effects (metrics, wake-ups, stall observations) of each part run after the commit,
those of an undone part never.

Several syncs a commit amortise what each transaction costs: BEGIN/COMMIT, the WAL frames of
pages they share (B-tree interior pages, the requests and sessions leaves of one cell's
sessions, `cell_load`), the effects' bookkeeping (bench/scale_ingest.py). A lone sync waits one
loop step, nothing more.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from scheduler.control.context import Effects

if TYPE_CHECKING:
    from scheduler.contract.protocol import TokenBatch
    from scheduler.control.context import Context
    from scheduler.control.ingest import Outcomes

MAX_SYNCS = 64
"""Syncs a transaction takes at most (the rest go into the next one, at once)."""

Accept = Callable[[Effects, str, "list[TokenBatch]"], "Outcomes"]


class GroupCommit:
    """Queues syncs' token batches and writes them together (see the module's docstring)."""

    def __init__(self, ctx: Context, accept: Accept, max_syncs: int = MAX_SYNCS) -> None:
        self.ctx = ctx
        self.accept = accept
        self.max_syncs = max_syncs
        self._queue: list[tuple[str, list[TokenBatch], asyncio.Future]] = []
        self.commits = 0
        """Transactions committed (with `syncs`: the syncs a commit carried on average)."""
        self.syncs = 0

    async def submit(self, cell_id: str, batches: list[TokenBatch]) -> Outcomes:
        """Queue a sync's batches; returns its outcomes once the transaction holding them has
        committed (raises its error if its part raised, or the commit's if the commit failed)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._queue.append((cell_id, batches, fut))
        if len(self._queue) == 1:
            loop.call_soon(self._commit)
        return await fut

    def _commit(self) -> None:
        items, self._queue = self._queue[:self.max_syncs], self._queue[self.max_syncs:]
        if self._queue:
            asyncio.get_running_loop().call_soon(self._commit)
        items = [it for it in items if not it[2].done()]  # a sync whose client left: nothing to write
        if not items:
            return
        store, outs = self.ctx.store, []
        try:
            with self.ctx.txn(durable=False) as fx:
                if len(items) == 1:  # a lone sync: its error undoes the transaction, no savepoint needed
                    outs.append(self.accept(fx, items[0][0], items[0][1]))
                for cell_id, batches, _ in items if len(items) > 1 else ():
                    outs.append(self._part(fx, store, cell_id, batches))
        except Exception as e:  # the commit itself failed: nothing of it is stored
            for _, _, fut in items:
                if not fut.done():
                    fut.set_exception(e)
            return
        self.commits += 1
        self.syncs += len(items)
        self.ctx.metrics.ingest_commits.inc()
        self.ctx.metrics.ingest_syncs.inc(len(items))
        for (_, _, fut), out in zip(items, outs):
            if fut.done():
                continue
            if isinstance(out, BaseException):
                fut.set_exception(out)
            else:
                fut.set_result(out)

    def _part(self, fx: Effects, store: Any, cell_id: str, batches: list[TokenBatch]) -> Outcomes | Exception:
        """One sync's part, in a savepoint; its effects join the transaction's only if it holds."""
        own = Effects(fx.registry, fx.notifier)
        try:
            with store.savepoint():
                out = self.accept(own, cell_id, batches)
        except Exception as e:
            return e
        fx.join(own)
        return out
