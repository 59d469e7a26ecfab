"""`python -m scheduler`: its command-line overrides reach the checks the config gets."""

from __future__ import annotations

from scheduler.__main__ import main


def test_host_override_is_checked_like_the_configs_host(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"scheduler:\n  auth: none\n  host: 127.0.0.1\n  db_path: {tmp_path / 'db.sqlite'}\n")
    assert main(["--config", str(cfg), "--host", "0.0.0.0", "--port", "1"]) == 2
    assert "non-loopback" in capsys.readouterr().err
    assert not (tmp_path / "db.sqlite").exists()  # refused before anything opened the store
