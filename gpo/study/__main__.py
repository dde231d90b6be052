"""`python -m gpo.study --child SPEC.json`: one run of `gpo study`, in its own process (see gpo/study/runner.py)."""

import sys

from gpo.study.child import child

if len(sys.argv) == 3 and sys.argv[1] == "--child":
    raise SystemExit(child(sys.argv[2]))
raise SystemExit("usage: python -m gpo.study --child SPEC.json (internal: one run of `gpo study`)")
