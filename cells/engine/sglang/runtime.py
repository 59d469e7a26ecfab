"""One SGLang engine and the asyncio loop this process drives it with.

The offline `sglang.Engine` runs its scheduler and detokenizer in child processes and keeps an
asyncio loop (`engine.loop`) in this process for its tokenizer manager. The adapter owns that
loop on the cell agent's engine thread. Every SGLang call runs inside it: SGLang's synchronous
control methods run the loop themselves (`control`), and the tokenizer manager's calls, whose
`zmq.asyncio` sends need the thread's running loop, are run as coroutines on it (`run`); called
bare from the agent's engine thread, `abort_request` raises "There is no current event loop in
thread 'engine'".

Every SGLang call of the adapter is made in this module (the contract test reads them from the
calls on `_engine`, `_tm`, `io_struct` and `control(...)`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Mapping
from typing import Any

from cells.engine.records import EngineError
from cells.engine.sglang import backend as sb

log = logging.getLogger(__name__)


class SGLangRuntime:
    """SGLang's processes, its loop, and the open request streams on that loop."""

    def __init__(self, modules: sb.SGLangModules, server_args: Mapping[str, Any]) -> None:
        self.modules = modules
        self.server_args = dict(server_args)
        self.start()

    def start(self) -> None:
        """Start SGLang (its scheduler processes, and the loop driven here), with the NCCL
        error mode chosen first: its processes inherit the environment."""
        sb.nccl_environment()
        self._engine = self.modules.Engine(**self.server_args)
        self.loop: asyncio.AbstractEventLoop = self._engine.loop
        self._tm = self._engine.tokenizer_manager
        self.ready = asyncio.Event()
        """Set when a chunk arrives (`step()` waits on it at most `poll_s`)."""
        self.streams: set[asyncio.Task] = set()
        """Open SGLang streams, aborted ones included until SGLang ends them."""

    @property
    def sglang(self) -> Any:
        """The `sglang.Engine` itself (tests reach the fake through it)."""
        return self._engine

    def run(self, coro: Coroutine) -> Any:
        """Run `coro` on SGLang's loop until it finishes (streams keep being collected)."""
        return self.loop.run_until_complete(coro)

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        """Start a stream's collector on the loop; it runs whenever the loop does."""
        task = self.loop.create_task(coro)
        self.streams.add(task)
        task.add_done_callback(self.streams.discard)
        return task

    async def wait_ready(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self.ready.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    # -- requests ---------------------------------------------------------------------------
    async def generate(self, *, input_ids: list[int], rid: str, sampling_params: dict, cache_salt: str):
        """One streaming submission with per-token log-probs."""
        return await self._engine.async_generate(input_ids=input_ids, return_logprob=True, stream=True, rid=rid,
                                                 sampling_params=sampling_params, cache_salt=cache_salt)

    def abort(self, rid: str) -> None:
        """Abort one submission. SGLang's `abort_request` is synchronous but sends on a
        `zmq.asyncio` socket, whose send needs the thread's running loop: run it inside ours."""
        async def send() -> None:
            self._tm.abort_request(rid=rid)

        self.run(send())

    def pause(self, mode: str) -> None:
        """Stop decoding: `in_place` keeps every request and its KV; `retract` moves running
        requests back to SGLang's queue and frees their KV (before a weight update)."""
        self.run(self._tm.pause_generation(self.modules.io_struct.PauseGenerationReqInput(mode=mode)))

    def continue_generation(self) -> None:
        self.run(self._tm.continue_generation(self.modules.io_struct.ContinueGenerationReqInput()))

    def label_version(self, version: int) -> None:
        """Name the version in SGLang too, so its per-token spans can be checked against ours."""
        obj = self.modules.io_struct.UpdateWeightVersionReqInput(new_version=str(version), abort_all_requests=False)
        self.run(self._tm.update_weight_version(obj))

    # -- control ----------------------------------------------------------------------------
    def control(self, name: str, **kwargs) -> None:
        """Call SGLang's synchronous engine method `name`; EngineError if it says it failed."""
        ok, message = sb.call_ok(getattr(self._engine, name)(**kwargs))
        if not ok:
            raise EngineError(f"SGLang {name} failed: {message}")

    def leave_group(self, group_name: str) -> None:
        try:
            self._engine.destroy_weights_update_group(group_name=group_name)
        except Exception as e:  # the group may not exist after a failed join
            log.warning("destroy_weights_update_group(%s): %s", group_name, e)

    def wait_streams(self, timeout_s: float) -> int:
        """Wait at most `timeout_s` for SGLang to end every open stream; returns how many are left."""
        if self.streams:
            self.run(asyncio.wait(set(self.streams), timeout=timeout_s))
        return len(self.streams)

    def close(self) -> None:
        """Stop collecting, then shut SGLang down (its child processes exit and free the GPU)."""
        for task in list(self.streams):
            task.cancel()
        self.wait_streams(5.0)
        self._engine.shutdown()
