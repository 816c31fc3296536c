"""`python -m services.sandbox`: the sandbox service's command line (same as `dockrl sandbox`)."""
import argparse
import sys

from services.common.config import exit_status
from services.sandbox.cli import add_arguments, run

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="dockrl sandbox", description="The code sandbox service: untrusted programs under bubblewrap.")
    add_arguments(parser)
    sys.exit(exit_status(lambda: run(parser.parse_args())))
