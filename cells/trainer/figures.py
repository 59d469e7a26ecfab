"""What the trainer reports of a step besides its own record: the update's figures for the
scheduler's metrics, and the proof that this process held and computed no model state."""

from __future__ import annotations

from cells.rl.update import PROCESS_COMPUTE_S
from cells.transport.p2p import TENSOR_BYTES


def trainer_compute_s() -> float:
    """Seconds of updates and supervised steps this process computed (0: the cells did)."""
    return sum(PROCESS_COMPUTE_S.values())


def trainer_state_bytes() -> int:
    """Tensor bytes this process sent or received through torch.distributed (0: no
    parameters, moments, EWMA or reference passed through it)."""
    return TENSOR_BYTES["sent"] + TENSOR_BYTES["received"]


def update_figures(metrics: dict, batch: list[dict], start_version: int, bound: int | None) -> dict:
    """What the scheduler's `cellflip_training_*` metrics show of one update: its KL, grad
    norm, clip fraction, entropy, outcome, and its trained tokens by versions behind its start."""
    behind: list[int] = []
    for t in batch:
        for m, v in zip(t["loss_mask"], t["versions"], strict=True):
            k = start_version - v if m and v is not None else None
            if k is None or (bound is not None and k > bound):
                continue  # a prompt token, or one the bound left out of the loss
            k = max(0, min(k, 64))
            behind += [0] * (k + 1 - len(behind))
            behind[k] += 1
    return {"update_kl": float(metrics.get("update_kl", 0.0)), "grad_norm": float(metrics.get("grad_norm", 0.0)),
            "clip_frac": float(metrics.get("clip_frac", 0.0)), "entropy": float(metrics.get("entropy_mean", 0.0)),
            "rejected": bool(metrics.get("update_rejected")), "staleness": behind}
