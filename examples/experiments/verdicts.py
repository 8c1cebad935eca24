"""Write the verdicts of docs/experiments.md from docs/experiments_data.json under the registered plan
(docs/experiments_plan.json) with the page's one decision rule.

Rewrites the summary table (between ``<!-- verdicts:begin -->`` and ``<!-- verdicts:end -->``) and every verdict
cell (``<!-- verdict:CLAIM.ID -->word<!-- /verdict -->``) of the page, and nothing else; ``--check`` changes
nothing and exits 1 if the page differs from what the rule computes (``rlhfkit.reporting.evidence``) or if a
result recording its commit was run before its claim was registered (the plan's git history).

    python examples/experiments/verdicts.py            # after changing docs/experiments_data.json
    python examples/experiments/verdicts.py --check
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlhfkit.errors import UserError
from rlhfkit.reporting.evidence import load, render
from rlhfkit.reporting.plan import load_plan, order_problems

DOCS = Path(__file__).resolve().parents[2] / "docs"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page", type=Path, default=DOCS / "experiments.md")
    parser.add_argument("--data", type=Path, default=DOCS / "experiments_data.json")
    parser.add_argument("--plan", type=Path, default=DOCS / "experiments_plan.json")
    parser.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if the page is not current"
    )
    args = parser.parse_args(argv)
    page = args.page.read_text()
    try:
        claims = load(args.data)
        new = render(page, claims, load_plan(args.plan))
        problems = order_problems(args.plan, claims) if args.check else []
    except (UserError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        for problem in problems:
            print(f"{args.plan}: {problem}")
        if new != page:
            print(f"{args.page} differs from what the rule computes from {args.data}: run without --check")
        if problems or new != page:
            return 1
        print(f"{args.page} is current")
        return 0
    if new != page:
        args.page.write_text(new)
    print(f"wrote {args.page}" if new != page else f"{args.page} unchanged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
