"""`python -m services.launch up|prepare|health ...`: the same commands as `dockrl up|prepare|health`."""
import sys

from services.cli import main

sys.exit(main())
