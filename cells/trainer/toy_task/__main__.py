"""`python -m cells.trainer.toy_task`: play episodes against a chat endpoint (see cli.py)."""

from cells.trainer.toy_task.cli import main

main()
