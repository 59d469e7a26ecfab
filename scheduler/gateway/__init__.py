"""The gateway: the OpenAI-compatible chat route over the token-in/token-out logic.

`tito/` is the pure TITO chat logic (no HTTP, no store), which the toy task also runs
in-process; the HTTP side is `router` (`make_chat_router(backend, tokenizer_name, ...)`) over
`intake` (the HTTP body in), `responses` (completion and error bodies) and `streaming` (SSE
chunks); `control_backend` is the backend over the control plane's store and cells;
`recording` hands the turn's messages as sent to it (recorded beside the request).

Importing this package imports nothing: `scheduler.gateway.tito` stays free of FastAPI, and
the router is imported from `scheduler.gateway.router`.
"""
