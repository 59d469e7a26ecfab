"""`cellflip up --ray`: the scheduler, the trainer coordinator and N cells as actors on a
running Ray cluster.

    connect → scheduler actor (pinned to its store's node) → placement group (one bundle per
    cell, SPREAD) → one cell actor per bundle → trainer actor → follow → stop

Ray places, restarts (bounded `max_restarts`) and logs the processes; cellflip decides what a
restarted cell may still own (fencing by incarnation). Actor calls carry JSON scalars only
(cells/launch/actors.py); each actor's tokens (its scopes' only) travel as environment
variables of its runtime env, or as the config's token file paths, never as call arguments.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import httpx

from cells.launch.actors import (
    SCHEDULER_NAME,
    TRAINER_NAME,
    CellActor,
    SchedulerActor,
    TrainerActor,
    cell_name,
)
from cells.localcluster import Cluster
from scheduler.contract.config import parse_config
from scheduler.contract.config.engine import SGLangEngineConfig
from scheduler.contract.config.launch import RayLauncherConfig
from scheduler.contract.tokens import SCOPES, auth_headers

RAY_HINT = "cellflip up --ray needs Ray: pip install 'cellflip[ray]'"


def import_ray():
    """Ray, or SystemExit with the install hint (the embedded default never imports it)."""
    try:
        import ray
    except ImportError:
        raise SystemExit(RAY_HINT) from None
    return ray


def absolute_paths(cfg: dict) -> dict:
    """`cfg` with its file paths made absolute against this directory: actors do not run in
    the directory `cellflip up` ran in (the store's path then names a file on its node)."""
    out = json.loads(json.dumps(cfg))
    sched = out.setdefault("scheduler", {})
    sched["db_path"] = os.path.abspath(sched.get("db_path", "runs/cellflip.sqlite"))
    for key in ("auth_token_file", "metrics_token_file", "trainer_token_file", "cell_token_file", "agent_token_file"):
        if sched.get(key):
            sched[key] = os.path.abspath(sched[key])
    trainer = out.get("trainer")
    if trainer and trainer.get("checkpoint_dir", "runs/trainer") is not None:
        trainer["checkpoint_dir"] = os.path.abspath(trainer.get("checkpoint_dir", "runs/trainer"))
    return out


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A head given as host:port answers on TCP, or SystemExit at once (Ray's own connect
    retries for minutes). `auto` is Ray's to resolve."""
    host, _, port = address.rpartition(":")
    if address == "auto" or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise SystemExit(f"cellflip up --ray: no Ray head answers at {address} ({e.strerror or e}); start one "
                         "with `ray start --head`, or give its address") from None


def cell_bundle(cfg, launcher: RayLauncherConfig) -> dict[str, float]:
    """One cell's placement-group bundle: its CPUs, and on GPU cells the tensor-parallel GPUs
    of one model replica (SGLang's `tp`, unless `gpus_per_cell` says otherwise)."""
    gpus = launcher.gpus_per_cell
    if gpus is None:
        gpus = cfg.cells.engine.tp if isinstance(cfg.cells.engine, SGLangEngineConfig) else 0
    return {"CPU": launcher.cpus_per_cell, **({"GPU": gpus} if gpus else {})}


class RayCluster(Cluster):
    """A deployment on Ray. The REST helpers (`cells`, `flip`, `wait_flip`, `session`…) are the
    local cluster's; processes are Ray actors, named in `launcher.namespace`."""

    def __init__(self, run_dir: str | Path, num_cells: int, cfg: dict, launcher: RayLauncherConfig,
                 progress=None) -> None:
        self.ray = import_ray()
        self.tmp = Path(run_dir).resolve()
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.cfg = absolute_paths(cfg)
        self.parsed = parse_config(self.cfg)
        Path(self.parsed.scheduler.db_path).parent.mkdir(parents=True, exist_ok=True)
        self.cfg_path = self.tmp / "cluster.yaml"
        self.cfg_path.write_text(json.dumps(self.cfg))
        self.launcher, self.namespace = launcher, launcher.namespace
        self.progress = progress or (lambda msg: None)
        self._reported: int | None = None
        self.procs = {}  # every process is Ray's
        self.actors: dict[str, object] = {}
        self.pg = None
        self.http = None
        self.tokens = self._tokens()
        self.token = self.tokens["admin"] if self.tokens else None
        self.headers = auth_headers(self.token)
        check_reachable(launcher.address)
        try:
            self.ray.init(address=launcher.address, namespace=self.namespace, log_to_driver=False,
                          configure_logging=False)
        except ConnectionError as e:
            raise SystemExit(f"cellflip up --ray: no Ray cluster at {launcher.address!r} ({e}); start one with "
                             "`ray start --head`, or give its address") from None
        try:
            self.start_scheduler()
            self.progress(f"placing {num_cells} cells ({launcher.placement}, one bundle each)")
            self.pg = self._placement_group(num_cells)
            for i in range(num_cells):
                self.start_cell(i)
            names = [f"cell-{i}" for i in range(num_cells)]
            self.wait(lambda: self.cells_ready(names), launcher.ready_timeout_s, "cells up", every=0.5)
        except BaseException:
            self.stop()  # never leave half a deployment on the cluster
            raise

    # -- actors -----------------------------------------------------------------------------
    def _options(self, name: str, scopes: tuple[str, ...], **kw) -> dict:
        """Actor options; its environment carries the tokens of `scopes` and no other (never a
        call argument)."""
        env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        env.update({k: v for k, v in self.scoped_env(*scopes).items() if v is not None})
        runtime_env: dict = {"env_vars": env}
        if self.launcher.py_modules:  # user code (a custom loss) on every node
            runtime_env["py_modules"] = [str(Path(m).resolve()) for m in self.launcher.py_modules]
        return {"name": name, "namespace": self.namespace, "max_restarts": self.launcher.max_restarts,
                "runtime_env": runtime_env, **kw}

    def _config_json(self) -> str:
        return json.dumps(self.cfg)

    def scheduler_node_id(self) -> str:
        """The node the scheduler's store lives on: the configured one, else this one."""
        want = self.launcher.scheduler_node
        if want is None:
            return self.ray.get_runtime_context().get_node_id()
        for node in self.ray.nodes():
            if node["Alive"] and want in (node["NodeID"], node["NodeManagerAddress"]):
                return node["NodeID"]
        raise SystemExit(f"cellflip up --ray: launcher.scheduler_node {want!r} is not a live Ray node")

    def _pinned(self):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return NodeAffinitySchedulingStrategy(self.scheduler_node_id(), soft=False)

    def start_scheduler(self, env: dict | None = None) -> None:
        self.progress(f"starting the scheduler actor (store {self.parsed.scheduler.db_path})")
        cls = self.ray.remote(SchedulerActor)
        self.actors["scheduler"] = cls.options(**self._options(SCHEDULER_NAME, SCOPES, num_cpus=1,
                                                               scheduling_strategy=self._pinned())).remote(
            self._config_json())
        self.url = self.ray.get(self.actors["scheduler"].url.remote(), timeout=self.launcher.ready_timeout_s)
        self.http = httpx.Client(base_url=self.url, timeout=30.0, headers=self.headers)
        self.wait(self._healthy, 30, "scheduler healthy")

    def _placement_group(self, num_cells: int):
        from ray.util.placement_group import placement_group

        pg = placement_group([self._bundle()] * num_cells, strategy=self.launcher.placement,
                             name=f"{self.namespace}-cells")
        try:
            self.ray.get(pg.ready(), timeout=self.launcher.ready_timeout_s)
        except self.ray.exceptions.GetTimeoutError:
            self.ray.util.remove_placement_group(pg)
            raise TimeoutError(f"the cells' placement group ({num_cells} × {self._bundle()}, "
                               f"{self.launcher.placement}) found no room within {self.launcher.ready_timeout_s}s; "
                               "see `ray status`") from None
        return pg

    def _bundle(self) -> dict[str, float]:
        return cell_bundle(self.parsed, self.launcher)

    def start_cell(self, i: int) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self._bundle()
        where = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i)
        cls = self.ray.remote(CellActor)
        self.actors[f"cell-{i}"] = cls.options(**self._options(
            cell_name(f"cell-{i}"), ("cell",), num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=where)).remote(self._config_json(), f"cell-{i}", self.namespace)

    def start_trainer(self, run_dir: str, tag: str = "run") -> None:
        """The trainer coordinator beside the scheduler (its checkpoints and run directory are
        paths on that node); resumes from its last checkpoint when Ray restarts it."""
        cls = self.ray.remote(TrainerActor)
        self.actors["trainer"] = cls.options(**self._options(TRAINER_NAME, ("trainer", "agent"), num_cpus=1,
                                                             scheduling_strategy=self._pinned())).remote(
            self._config_json(), os.path.abspath(run_dir), self.namespace, tag)

    def info(self, name: str, timeout_s: float = 60) -> dict:
        """What the actor reports about itself (pid, node, incarnation for cells)."""
        return json.loads(self.ray.get(self.actors[name].info.remote(), timeout=timeout_s))

    def cells_ready(self, names: list[str]) -> bool:
        """Every named cell's actor runs an incarnation that the scheduler has in rollout (a
        store kept from an earlier run still lists the old ones)."""
        rows = {c["id"]: c for c in self.cells()}
        ready = 0
        for name in names:
            try:
                inc = self.info(name, timeout_s=2)["incarnation"]
            except self.ray.exceptions.GetTimeoutError:
                continue  # still building its engine
            row = rows.get(name)
            ready += bool(inc) and row is not None and row["incarnation"] == inc and row["state"] == "rollout"
        if ready != self._reported:
            self._reported = ready
            self.progress(f"cells in rollout: {ready}/{len(names)}")
        return ready == len(names)

    def kill(self, name: str, sig=None, restart: bool = True) -> None:
        """Kill the actor's process; Ray restarts it (a new incarnation) unless `restart` is off."""
        self.ray.kill(self.actors[name], no_restart=not restart)

    # -- shutdown ---------------------------------------------------------------------------
    def stop(self, grace_s: float = 10.0) -> list[str]:
        """Ask every actor to stop, then kill it for good (no restart), remove the placement
        group and disconnect; returns the names whose graceful stop did not answer in time."""
        ray, late = self.ray, []
        order = [n for n in self.actors if n == "trainer"] + [n for n in self.actors if n.startswith("cell-")]
        order += [n for n in self.actors if n == "scheduler"]
        for group in ([n for n in order if n != "scheduler"], [n for n in order if n == "scheduler"]):
            refs = {name: self.actors[name].stop.remote() for name in group}
            for name, ref in refs.items():
                try:
                    ray.get(ref, timeout=grace_s)
                except ray.exceptions.RayError:
                    late.append(name)
                ray.kill(self.actors[name], no_restart=True)
        if self.pg is not None:
            ray.util.remove_placement_group(self.pg)
        if self.http is not None:
            self.http.close()
        ray.shutdown()
        return late

    def logs(self) -> str:
        return "(actor logs: Ray's log directory on each node, or the Ray dashboard's actor pages)"


def follow_trainer(cluster: RayCluster, status_path: Path, steps: int, plain: bool) -> int:
    """Until the trainer actor finishes: the live view (or its status lines), its status
    mirrored into `status_path` on this machine. Non-zero if an actor died for good."""
    from cells import display

    ray, trainer = cluster.ray, cluster.actors["trainer"]
    state = {"seen": 0, "result": None, "dead": None}

    def poll() -> bool:
        try:
            lines = json.loads(ray.get(trainer.status.remote(state["seen"]), timeout=30))
            with open(status_path, "a") as f:
                f.writelines(json.dumps(rec) + "\n" for rec in lines)
            if plain:
                for rec in lines:
                    print(json.dumps(rec), flush=True)
            state["seen"] += len(lines)
            state["result"] = ray.get(trainer.result.remote(), timeout=30)
        except ray.exceptions.GetTimeoutError:
            pass  # busy or restarting: ask again
        except ray.exceptions.RayActorError as e:
            state["dead"] = str(e)
        return state["result"] is not None or state["dead"] is not None

    if plain:
        while not poll():
            time.sleep(0.5)
    else:
        stop = threading.Event()
        last = display.watch(cluster.url, status_path, steps, lambda: stop.is_set() or poll(),
                             headers=cluster.headers)
        if last is not None:
            from rich.console import Console

            Console().print(display.summary_table(last))
    if state["dead"] is not None:
        print(f"the trainer actor died: {state['dead']}", flush=True)
        return 1
    print(json.dumps({"summary": json.loads(state["result"])}), flush=True)
    return 0


def wait_while_alive(cluster: RayCluster, every_s: float = 2.0) -> int:
    """Serve until Ctrl-C; 1 once an actor has not answered for `ready_timeout_s` (its
    restarts spent, or its node gone)."""
    ray = cluster.ray
    failing_since: dict[str, float] = {}
    while True:
        for name, actor in cluster.actors.items():
            try:
                ray.get(actor.info.remote(), timeout=30)
                failing_since.pop(name, None)
            except ray.exceptions.RayError as e:  # restarting, or dead
                since = failing_since.setdefault(name, time.monotonic())
                if time.monotonic() - since > cluster.launcher.ready_timeout_s:
                    print(f"actor {name} has not answered for {cluster.launcher.ready_timeout_s:.0f}s ({e}); "
                          "shutting down", flush=True)
                    return 1
        time.sleep(every_s)


def up(raw: dict, launcher: RayLauncherConfig, *, num_cells: int, run_dir: str, train: bool, steps: int,
       plain: bool, say, stay: bool = True) -> int:
    """`cellflip up --ray`: start the deployment on the Ray cluster, follow it, stop it
    (after the training run unless `stay`: then on Ctrl-C, as without a trainer)."""
    try:
        cluster = RayCluster(run_dir, num_cells, raw, launcher, progress=say)
    except KeyboardInterrupt:
        return 0  # stopped while starting: the launcher took down what it had started
    except TimeoutError as e:
        say(f"start-up failed, everything it had started is stopped: {e}")
        return 1
    try:
        url = cluster.url
        nodes = sorted({c.get("capabilities", {}).get("node", "?") for c in cluster.cells()})
        say(f"API {url} (OpenAPI {url}/docs), OpenAI-compatible gateway {url}/v1, metrics {url}/metrics")
        say(f"{num_cells} cells in rollout on {len(nodes)} node(s): {', '.join(nodes)}; Ray namespace "
            f"{cluster.namespace!r} (actor logs in the Ray dashboard); Ctrl-C stops everything")
        if not train:
            return wait_while_alive(cluster)
        status = Path(run_dir) / "trainer.ray.jsonl"
        status.unlink(missing_ok=True)
        cluster.start_trainer(run_dir)
        rc = follow_trainer(cluster, status, steps, plain)
        if rc != 0 or not stay:
            return rc
        say("training finished; Ctrl-C stops the deployment")
        return wait_while_alive(cluster)
    except KeyboardInterrupt:
        return 0
    finally:
        late = cluster.stop()
        say("stopped" + (f" (killed without a graceful stop: {', '.join(late)})" if late else ""))
