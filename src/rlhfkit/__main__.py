"""`python -m rlhfkit ...` is the `rlhfkit` command."""

from rlhfkit.cli import console

console()
