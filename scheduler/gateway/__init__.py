"""The gateway's HTTP side: the OpenAI-compatible chat route over the TITO logic of
scheduler/contract/tito. `router` wires it (`make_chat_router(backend, tokenizer_name, ...)`)
over `intake` (the HTTP body in), `responses` (completion and error bodies) and `streaming`
(SSE chunks); `control_backend` is the backend over the control plane's store and cells; `recording` hands the
turn's messages as sent to it (recorded beside the request).
"""

from scheduler.gateway.router import SESSION_HEADER, make_chat_router

__all__ = ["SESSION_HEADER", "make_chat_router"]
