"""`python -m gpo ...` (used by `accelerate launch -m gpo run ...`)."""

from gpo.cli import main

raise SystemExit(main())
