"""Identifier rules shared by every route that takes them, so an id one route accepts every
other route can name (a session id a turn opened can be read and finished)."""

from __future__ import annotations

import re

SESSION_ID_PATTERN = r"^[A-Za-z0-9._:@-]{1,128}$"
"""A session id (`X-Session-Id`, `/v1/sessions/{session_id}`): 1-128 of A-Z a-z 0-9 . _ : @ -
(no `/`: it must fit one path segment)."""
SESSION_ID_RE = re.compile(SESSION_ID_PATTERN)
SESSION_ID_RULE = "1-128 of A-Z a-z 0-9 . _ : @ -"
