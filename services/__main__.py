"""`python -m services` is the `dockrl` CLI."""
import sys

from services.cli import main

sys.exit(main())
