"""Dependencies: the controller lives on app.state (built by the lifespan), never in a global."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from scheduler.controller import Controller


def get_controller(request: Request) -> Controller:
    return request.app.state.controller


Ctl = Annotated[Controller, Depends(get_controller)]
