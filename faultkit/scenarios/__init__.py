"""Every scenario by name, and the canary's plan."""

from __future__ import annotations

from collections.abc import Callable

from faultkit.runs import Run
from faultkit.scenarios.cells import scn_rogue_cell, scn_training_rank_fault
from faultkit.scenarios.control import (
    scn_broadcast_receiver,
    scn_scheduler_kill_flip,
    scn_scheduler_kill_migration,
    scn_scoring_fault,
    scn_trainer_kill_broadcast,
)
from faultkit.scenarios.migration import (
    scn_mig_kill_destination,
    scn_mig_kill_source,
    scn_mig_raise,
    scn_partition_transfer,
    scn_zombie_cell,
    scn_zombie_destination,
)
from faultkit.settings import DST_FPS
from faultkit.verdicts import Verdicts

SCENARIOS: dict[str, Callable[[Verdicts, Run, int], None]] = {
    "mig_kill_source": scn_mig_kill_source,
    "mig_kill_destination": scn_mig_kill_destination,
    "mig_raise": scn_mig_raise,
    "partition_transfer": scn_partition_transfer,
    "zombie_cell": scn_zombie_cell,
    "zombie_destination": scn_zombie_destination,
    "scheduler_kill_flip": scn_scheduler_kill_flip,
    "scheduler_kill_migration": scn_scheduler_kill_migration,
    "trainer_kill_broadcast": scn_trainer_kill_broadcast,
    "broadcast_receiver": scn_broadcast_receiver,
    "scoring_fault": scn_scoring_fault,
    "training_rank_fault": scn_training_rank_fault,
    "rogue_cell": scn_rogue_cell,
}

CANARY_PLAN = [("zombie_destination", 0), ("mig_kill_destination", DST_FPS.index("migrate.after_commit")),
               ("zombie_cell", 0)]
"""The canary run: the scenarios where split ownership is one refused message away: the
destination of a migration committed, then went silent or died past the source's transfer
timeout (the cells' migration logs show the split); a cell stopped past its lease wakes and
syncs the tokens it decoded for requests re-placed meanwhile (the store's own token history
shows them)."""
