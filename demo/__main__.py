"""``python -m demo``."""

from demo.cli import main

raise SystemExit(main())
