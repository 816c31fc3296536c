"""`python -m services.rollout`: the rollout server's command line."""
import argparse
import sys

from services.common.config import exit_status
from services.rollout import cli

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m services.rollout", description=cli.__doc__)
    cli.add_arguments(parser)
    sys.exit(exit_status(lambda: cli.run(parser.parse_args())))
