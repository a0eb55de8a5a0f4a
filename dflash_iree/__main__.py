"""`python -m dflash_iree` runs the CLI."""

from .cli import main

raise SystemExit(main())
