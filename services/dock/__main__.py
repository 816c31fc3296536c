"""`python -m services.dock`: the same as `dockrl dock`."""
import argparse
import sys

from services.common.config import exit_status
from services.dock.cli import add_arguments, run

parser = argparse.ArgumentParser(prog="python -m services.dock", description="Look at or empty a run's data dock in Redis.")
add_arguments(parser)
sys.exit(exit_status(lambda: run(parser.parse_args())))
