"""`python -m services.launch`: up, prepare, health."""
import sys

from services.launch.cli import main

sys.exit(main())
