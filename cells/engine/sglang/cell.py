"""What the cell agent, `CellVersions` and role flips call on an engine, for `SGLangEngine`.

The agent was written against the embedded engine's duck-typed surface; this mixin gives
SGLang the same names with SGLang's semantics, built only on the adapter's own methods
(every SGLang call stays in engine.py / control.py, where the contract test
checks it):

- versions: `prepare_weights` (loader thread: check against the checkpoint) →
  `install_prepared` → in-place `load_weights` (paused for the update, continued after).
  SGLang holds only the served version; older ones live on in the scoring copy
  (`scoring: cell_copy`) until `drop_version`. With `trainer_copy` the cell holds no
  version for scoring (`versions_held` is empty, `scorer` None): the scheduler has a cell
  that can score fetch the version from the trainer's kept copy (docs/GPU.md section 6).
- `recompute_all`: nothing to do, every in-flight request is already re-submitted under the
  new version at each update (engine.py's module docstring).
- roles: `enter_role("training")` releases GPU memory (once no request remains) and pauses;
  `enter_role("rollout")` resumes it and continues. A version that arrives while the
  weights' memory is released is kept in host memory and installed at the flip back, in
  the handover's order: resume(weights) → version update → resume(kv_cache).
"""

from __future__ import annotations

import logging

import torch

from cells.engine.records import EngineError
from cells.engine.sglang import backend as sb
from cells.engine.sglang.weights import TensorMeta, check_against_manifest

log = logging.getLogger(__name__)

NO_VERSION = -1
"""`version` while no complete version is loaded (weights released without a CPU backup, or
an update that failed half-way): below every real version, so whatever version arrives is
installed. `summary()` reports it as None."""

ROLE_TAGS = ("weights", "kv_cache")
"""GPU memory handed to the training role and back."""


class CellMixin:
    """The agent-facing half of `SGLangEngine` (see the module docstring)."""

    # -- versions ----------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The version this cell serves, or will serve once back in rollout (one received
        while its weights' memory was released); `NO_VERSION` if none."""
        if self._deferred is not None:
            return self._deferred[0]
        return self._version if self._weights_valid else NO_VERSION

    @property
    def versions_held(self) -> list[int]:
        """Versions this cell can score: the scoring copy's (`cell_copy`); none with
        `trainer_copy` (another cell scores them, from the trainer's kept copy)."""
        return self._scoring.held if self._scoring is not None else []

    def prepare_weights(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Check a version's tensors against the checkpoint (names, shapes, dtypes) on the
        loader thread, so a bad version is refused before it is staged. Nothing else can be
        done ahead: SGLang updates in place. Returns the tensors for `install_prepared`."""
        check_against_manifest([TensorMeta.of(n, t) for n, t in tensors.items()], self.manifest, require_all=False)
        return dict(tensors)

    def install_prepared(self, version: int, tensors: dict[str, torch.Tensor], *, activate: bool = True) -> None:
        """Between steps: serve `version` (in-place update; the scoring copy keeps the old
        version until `drop_version`), or with `activate=False` hold it for scoring only.
        While the weights' memory is released (training role) an activated version is kept
        in host memory and installed by `enter_role("rollout")`."""
        if not activate:
            self.hold_weights(version, tensors)
        elif "weights" in self._released:
            self._defer(version, tensors)
        else:
            self.load_weights(version, tensors, keep_previous=True)

    def hold_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Keep `version` for scoring only, in the scoring copy (SGLang serves one version)."""
        if self._scoring is None:
            raise EngineError(f"scoring: trainer_copy keeps no weights on this cell: version {version} "
                              "is scored by the trainer from its kept copy")
        self._scoring.hold(version, tensors)

    def scorer(self, version: int):
        """The scoring copy's `fn(token_ids, temperature)` for `version`, or None where the
        cell does not hold it (always with `trainer_copy`)."""
        return self._scoring.scorer(version) if self._scoring is not None else None

    def drop_version(self, version: int) -> None:
        """Free an old version from the scoring copy (the served one cannot be dropped)."""
        if version == self.version:
            raise EngineError(f"cannot drop the served version {version}")
        if self._scoring is not None:
            self._scoring.drop(version)

    def recompute_all(self) -> int:
        """The `recompute` policy after an update: nothing left to do, since every update
        already re-submits each in-flight request under the new version (its KV is
        recomputed by SGLang). Returns the requests re-prefilled by this call: 0."""
        return 0

    def _defer(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Keep `version` for `enter_role("rollout")`. Versions deferred one after another
        merge (in-place updates compose); a cell whose weights came back empty needs every
        tensor of the checkpoint."""
        if self._deferred is not None and version <= self._deferred[0]:
            raise EngineError(f"version {version} is not newer than version {self._deferred[0]} awaiting install")
        merged = {**(self._deferred[1] if self._deferred is not None else {}), **tensors}
        check_against_manifest([TensorMeta.of(n, t) for n, t in merged.items()], self.manifest,
                               require_all=not self._weights_valid)
        self._deferred = (version, merged)
        log.info("version %d kept in host memory until the cell returns to rollout", version)

    # -- requests (the embedded engine's hand-over names) ------------------------------

    def release(self, request_id: str) -> None:
        """Forget a request here (an import not yet started, or one that moved away).
        Unknown ids are ignored."""
        self.abort(request_id)

    @property
    def block_size(self) -> int:
        """Tokens per KV page in SGLang (`page_size`, 1 by default)."""
        return int(self.server_args.get("page_size") or 1)

    # -- roles -------------------------------------------------------------------------

    def enter_role(self, role: str) -> None:
        """Hand GPU memory over at a role flip. `training`: release weights and KV cache
        (refused while any request remains) and pause. `rollout`: resume the weights, install
        a version that arrived meanwhile, resume the KV cache, continue. Refused (memory left
        released) when there is no complete version to serve. Idempotent."""
        if role == "training":
            self._to_training()
        elif role == "rollout":
            self._to_rollout()
        else:
            raise EngineError(f"unknown role {role!r}; expected 'training' or 'rollout'")

    def _to_training(self) -> None:
        tags = [t for t in ROLE_TAGS if t not in self._released]
        if tags:
            self.release_memory(tags)
        if self._state == "serving":
            self.pause()

    def _to_rollout(self) -> None:
        if self._deferred is None and not self._weights_valid:
            raise EngineError("no complete weight version to serve: the weights were released without "
                              "enable_weights_cpu_backup (or an update failed) and no version has arrived since")
        resumed = False
        if "weights" in self._released:
            self.resume_memory(["weights"])
            resumed = True
        if self._deferred is not None:
            version, tensors = self._deferred
            self._deferred = None
            try:
                self.load_weights(version, tensors, keep_previous=True)
            except EngineError:
                if resumed:  # back to where the training role had it
                    self.release_memory(["weights"])
                raise
        rest = [t for t in sb.GPU_MEMORY_TAGS if t in self._released]
        if rest:
            self.resume_memory(rest)
        self.resume()
