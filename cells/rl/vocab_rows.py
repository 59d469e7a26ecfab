"""The learner's forward on a compacted vocabulary.

When the output ids are restricted, a micro-batch's forward uses leaf copies of only the
embedding / output-layer rows its tokens and the output ids touch, ids remapped
monotonically: the same rows in the same order enter the same kernels, so the log-probs
are bitwise those of the full model, and the rows' gradient is added back into the full
table once (autograd through ``index_select`` on the 151,936-row table would otherwise
materialise a dense gradient of the whole table per use).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from cells.engine.embedded.model_spec import ModelSpec

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
"""The vocabulary tables (tied in the toy model)."""

__all__ = ["EMBED", "HEAD", "VocabRows", "id_ranges"]


def id_ranges(ids: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Token ids as sorted half-open ranges (the form of ModelSpec.output_id_ranges)."""
    out: list[list[int]] = []
    for i in sorted(set(ids)):
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return tuple((a, b) for a, b in out)


class VocabRows:
    """Compaction of a model spec's vocabulary to the rows a batch touches."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        out = spec.output_ids()
        self.out_ids = torch.tensor(out, dtype=torch.long) if out is not None else None
        """The output ids (None: the softmax spans the whole vocabulary, nothing compacts)."""

    def compact(self, weights: dict[str, Tensor], seqs: Sequence[Tensor], grad: bool
                ) -> tuple[ModelSpec, dict[str, Tensor], Tensor | None, list[Tensor]]:
        """The model restricted to the vocabulary rows that `seqs` and the output ids use.

        Returns (spec, weights with leaf copies of those rows when `grad`, the rows, the
        remapped ids). Without restricted output ids the softmax spans the whole vocabulary,
        so nothing is compacted (rows None)."""
        if self.out_ids is None:
            w = {k: (v if grad else v.detach()) for k, v in weights.items()}
            return self.spec, w, None, list(seqs)
        rows = torch.unique(torch.cat([*seqs, self.out_ids]))  # sorted: output order kept
        out = torch.searchsorted(rows, self.out_ids).tolist()
        spec = replace(self.spec, vocab_size=len(rows), output_id_ranges=id_ranges(out))
        w = dict(weights)
        for name in (EMBED, HEAD):
            if name in w:
                sub = w[name].detach().index_select(0, rows)
                w[name] = sub.requires_grad_(True) if grad else sub
        return spec, w, rows, [torch.searchsorted(rows, s) for s in seqs]

    @staticmethod
    def add_grads(params: dict[str, Tensor], w: dict[str, Tensor], rows: Tensor | None) -> None:
        """Add the compact rows' gradients (of `w`) into the full tables' gradients."""
        if rows is None:
            return
        for name in (EMBED, HEAD):
            if name in w and w[name].grad is not None:
                full = params[name]
                if full.grad is None:
                    full.grad = torch.zeros_like(full)
                full.grad.index_add_(0, rows, w[name].grad)

    def row_marks(self, params: dict[str, Tensor]) -> dict[str, Tensor]:
        """Per-row "touched" marks of the vocabulary tables ({} when nothing compacts)."""
        if self.out_ids is None:
            return {}
        return {k: torch.zeros(params[k].shape[0], dtype=torch.bool)
                for k in (EMBED, HEAD) if k in params}
