"""`python -m rlhfkit ...` is the `rlhfkit` command."""

from rlhfkit.cli import main

raise SystemExit(main())
