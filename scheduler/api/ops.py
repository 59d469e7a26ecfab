"""Liveness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST

from scheduler.api.deps import ApiRoute, Ctl
from scheduler.api.schemas import errors

router = APIRouter(tags=["ops"], route_class=ApiRoute)


@router.get("/healthz")
async def healthz(ctl: Ctl) -> dict:
    return {"ok": True, "ready": ctl.ready}


@router.get("/metrics", response_class=Response,
            responses={200: {"description": "Prometheus text exposition format",
                             "content": {"text/plain": {"schema": {"type": "string"}}}}, **errors(401, 403)})
async def metrics(ctl: Ctl) -> Response:
    return Response(ctl.metrics.render(), media_type=CONTENT_TYPE_LATEST)
