"""Liveness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST

from scheduler.api.deps import Ctl

router = APIRouter(tags=["ops"])


@router.get("/healthz")
async def healthz(ctl: Ctl) -> dict:
    return {"ok": True, "ready": ctl.ready}


@router.get("/metrics")
async def metrics(ctl: Ctl) -> Response:
    return Response(ctl.metrics.render(), media_type=CONTENT_TYPE_LATEST)
