"""The Ray actors of a cellflip deployment: thin shells that run the real entry points.

    SchedulerActor  the control plane (FastAPI app + controller) in the actor process, pinned
                    to the node of its store; named `cellflip-scheduler`: cells and the
                    trainer ask it for the URL at start and after a restart.
    CellActor       one cell: engine + agent loops in the actor process, transfers bound to
                    the address Ray reports for the node. A restarted actor is a new
                    incarnation (the agent registers under a fresh id; the scheduler fences
                    the old one).
    TrainerActor    the trainer (coordinator metadata, its rendezvous store, RL loop; no model
                    state); when Ray restarts it, it resumes at the newest commit the cells or
                    its checkpoint hold.

The real code runs in the actor process itself, so Ray's restart semantics apply directly: the
actor's death is the process's death. Every method is a `json_boundary`: arguments and
results are JSON scalars (structured values travel as JSON text), so no cellflip data goes
through Ray's object store; tensors stay on torch.distributed. Each actor gets the token of its
scope and no other (the scheduler every scope's, a cell the cell token, the trainer the trainer
and agent tokens) as environment variables set by the launcher, or the config's token files.

This module imports Ray only inside the actors: the embedded default never needs it.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path

import httpx

from cells.client import SchedulerClient

log = logging.getLogger("cellflip.ray")

SCHEDULER_NAME = "cellflip-scheduler"
TRAINER_NAME = "cellflip-trainer"
PLAIN = (str, int, float, bool, type(None))
"""What may cross an actor boundary: JSON scalars (structured values as JSON text)."""
LOOKUP_TIMEOUT_S = 120.0
"""Bound on finding the scheduler's named actor and its URL (it may be restarting)."""
URL_FILE = "scheduler.url.json"
"""Beside the store: the port a restarted scheduler actor binds again, so URLs stay valid."""


def cell_name(cell_id: str) -> str:
    return f"cellflip-{cell_id}"


def check_plain(value, where: str) -> None:
    """Refuse anything but a JSON scalar at an actor boundary (TypeError naming `where`)."""
    if not isinstance(value, PLAIN):
        raise TypeError(f"{where}: only str/int/float/bool/None cross a cellflip actor boundary, "
                        f"got {type(value).__name__}")


def json_boundary(fn):
    """Mark and guard an actor method: its arguments and its result are JSON scalars."""
    @functools.wraps(fn)
    def guarded(self, *args, **kwargs):
        for i, a in enumerate((*args, *kwargs.values())):
            check_plain(a, f"{type(self).__name__}.{fn.__name__} argument {i}")
        out = fn(self, *args, **kwargs)
        check_plain(out, f"{type(self).__name__}.{fn.__name__} result")
        return out

    guarded.json_boundary = True
    return guarded


def node_address() -> tuple[str, str]:
    """(IP, node id) of this actor's node as Ray reports them: peers reach its transfers there."""
    import ray

    return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()


def scheduler_url(namespace: str, timeout_s: float = LOOKUP_TIMEOUT_S) -> str:
    """The scheduler's URL, from its named actor (waits while it is missing or restarting)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            actor = ray.get_actor(SCHEDULER_NAME, namespace=namespace)
            return ray.get(actor.url.remote(), timeout=max(1.0, deadline - time.monotonic()))
        except (ValueError, ray.exceptions.RayError) as e:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no scheduler actor {SCHEDULER_NAME!r} in namespace {namespace!r}: {e}") from e
            time.sleep(0.5)


def _load(config_json: str):
    """The deployment's config; also points this process's logging at Ray's worker log."""
    from scheduler.contract.config import parse_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return parse_config(json.loads(config_json), "launcher config")


def _die_with(target, name: str):
    """Run `target` on a thread; if it ends while the actor should live, the process exits so
    that Ray restarts the actor (a half-dead actor would never be restarted)."""
    stopping = threading.Event()

    def body():
        try:
            target()
        except BaseException:  # noqa: BLE001  (logged, then the process goes)
            log.exception("%s failed", name)
        if not stopping.is_set():
            log.error("%s ended unexpectedly: exiting so that Ray restarts the actor", name)
            logging.shutdown()
            os._exit(1)

    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    return thread, stopping


class SchedulerActor:
    """The control plane in this process: uvicorn serving `scheduler.api.app` on the node's IP."""

    def __init__(self, config_json: str) -> None:
        import uvicorn

        from scheduler.contract.config import SCHEDULER_CONFIG_ENV, SHARED_PROCESS_ENV

        cfg = _load(config_json)
        self.ip, self.node_id = node_address()
        url_file = Path(cfg.scheduler.db_path).resolve().parent / URL_FILE
        port = cfg.scheduler.port or _remembered_port(url_file, self.ip) or _free_port(self.ip)
        sched = cfg.scheduler.model_copy(update={"host": self.ip, "port": port})
        # the app is built by module path from the config's JSON text, in this process
        os.environ[SCHEDULER_CONFIG_ENV] = cfg.model_copy(update={"scheduler": sched}).model_dump_json()
        os.environ[SHARED_PROCESS_ENV] = "1"  # this process runs more than the scheduler: its GC is left alone
        # by module path, as the app: one socket write per response (scheduler/api/httpwire.py)
        self.server = uvicorn.Server(uvicorn.Config("scheduler.api.app:create_app_from_env", factory=True,
                                                    host=self.ip, port=port, log_level="warning",
                                                    http="scheduler.api.httpwire:Protocol"))
        self.thread, self._stopping = _die_with(self.server.run, "scheduler")
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("the scheduler did not start within 60 s")
            time.sleep(0.05)
        self._url = f"http://{self.ip}:{port}"
        url_file.write_text(json.dumps({"port": port, "node": self.node_id}))
        log.info("scheduler actor serving %s (store %s)", self._url, cfg.scheduler.db_path)

    @json_boundary
    def url(self) -> str:
        return self._url

    @json_boundary
    def info(self) -> str:
        return json.dumps({"url": self._url, "pid": os.getpid(), "node": self.ip, "node_id": self.node_id})

    @json_boundary
    def stop(self) -> bool:
        self._stopping.set()
        self.server.should_exit = True
        self.thread.join(timeout=30)
        return not self.thread.is_alive()


def _remembered_port(url_file: Path, host: str) -> int | None:
    """The port an earlier actor on this store served on, if it can be bound again (a
    restart keeps the URL; anything else gets a fresh port, found through the named actor)."""
    try:
        port = int(json.loads(url_file.read_text())["port"])
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds it
            s.bind((host, port))
        return port
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class _LoopActor:
    """An actor whose work is one loop on `self.thread`, ended by `self.stop_event`."""

    thread: threading.Thread
    stop_event: threading.Event
    _stopping: threading.Event

    @json_boundary
    def stop(self) -> bool:
        self._stopping.set()
        self.stop_event.set()
        self.thread.join(timeout=30)
        return not self.thread.is_alive()


class CellActor(_LoopActor):
    """One cell: its engine and agent in this process; a new incarnation on every (re)start."""

    def __init__(self, config_json: str, cell_id: str, namespace: str) -> None:
        from cells.agent import CellAgent
        from cells.entry import build_engine
        from scheduler.contract.tokens import client_token

        cfg = _load(config_json)
        self.cell_id, self.namespace = cell_id, namespace
        self.ip, self.node_id = node_address()
        url = scheduler_url(namespace)
        token = client_token(cfg.scheduler, scope="cell")
        engine = build_engine(cfg.cells.engine)
        sys.setswitchinterval(0.0005)  # as `cellflip cell`: transfer threads wake promptly
        self.agent = CellAgent(cfg, cell_id=cell_id, scheduler_url=url, engine=engine, host=self.ip, token=token)
        self.agent.manage_gc()  # one actor per process
        self.agent.client.close()
        self.agent.client = RayNodeClient(url, token, node=f"{self.ip}/{self.node_id[:12]}",
                                          resolve=lambda: scheduler_url(namespace))
        self.stop_event = threading.Event()
        self.thread, self._stopping = _die_with(lambda: self.agent.run(self.stop_event), f"cell {cell_id}")

    @json_boundary
    def info(self) -> str:
        return json.dumps({"cell_id": self.cell_id, "incarnation": self.agent.incarnation, "pid": os.getpid(),
                           "node": self.ip, "node_id": self.node_id})


class RayNodeClient(SchedulerClient):
    """The agent's scheduler client under Ray: stamps the node on registration, and finds the
    scheduler again through its named actor when it cannot be reached (a restarted actor)."""

    def __init__(self, url: str, token: str | None, *, node: str, resolve) -> None:
        super().__init__(url, token)
        self.node, self._resolve = node, resolve

    def register(self, req):
        """Registration waits out a restarting scheduler (bounded) instead of failing the
        actor: a cell restart is for the cell's own faults."""
        req.node = self.node
        deadline = time.monotonic() + LOOKUP_TIMEOUT_S
        while True:
            try:
                return super().register(req)
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def _post(self, path: str, body: dict, timeout: float | None = None) -> dict:
        try:
            return super()._post(path, body, timeout)
        except httpx.TransportError:
            self._follow()
            raise  # the agent's own retry goes to the (possibly new) address

    def _follow(self) -> None:
        try:
            url = self._resolve().rstrip("/")
        except TimeoutError as e:
            log.warning("scheduler not found: %s", e)
            return
        if url != self.url:
            log.info("scheduler moved to %s", url)
            self.url = url
            self.http.base_url = url


class TrainerActor(_LoopActor):
    """The trainer coordinator in this process; its status lines are read through `status`."""

    def __init__(self, config_json: str, run_dir: str, namespace: str, tag: str) -> None:
        import torch

        from cells.trainer.trainer import Trainer
        from scheduler.contract.tokens import client_token

        torch.set_num_threads(1)
        cfg = _load(config_json)
        self.ip, self.node_id = node_address()
        cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"host": self.ip})})
        self.run_dir = Path(run_dir)
        self.trainer = Trainer(cfg, scheduler_url(namespace), run_dir=run_dir,
                               token=client_token(cfg.scheduler, scope="trainer"),
                               agent_token=client_token(cfg.scheduler, scope="agent"), tag=tag)
        self.summary: dict | None = None
        self.stop_event = threading.Event()
        self.thread, self._stopping = _die_with(self._run, "trainer")

    def _run(self) -> None:
        self.summary = self.trainer.run(self.stop_event)
        self._stopping.set()  # finished: the actor stays, idle, for `result`

    @json_boundary
    def status(self, since: int) -> str:
        """The trainer's status lines from index `since` on, as a JSON list."""
        from cells.display import read_status

        return json.dumps(read_status(self.trainer.status_path)[since:])

    @json_boundary
    def result(self) -> str | None:
        """The run's summary (JSON) once the trainer has finished; None before."""
        return None if self.summary is None else json.dumps(self.summary)

    @json_boundary
    def info(self) -> str:
        return json.dumps({"pid": os.getpid(), "node": self.ip, "node_id": self.node_id})


ACTOR_CLASSES = (SchedulerActor, CellActor, TrainerActor)
