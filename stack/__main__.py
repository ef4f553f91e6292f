"""``python -m stack``."""

from stack.run import main

raise SystemExit(main())
