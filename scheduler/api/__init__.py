"""The REST API: the app factory (app.py), bearer auth, request limits, idempotency and one
router per resource (routes.py)."""
