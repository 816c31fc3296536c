"""`python -m services.reward`: the reward service's command line (same as `dockrl reward`)."""
import argparse
import sys

from services.common.config import exit_status
from services.reward.cli import add_arguments, run

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="dockrl reward", description="The reward service: rule verifiers and, with reward_config.load, a reward model.")
    add_arguments(parser)
    sys.exit(exit_status(lambda: run(parser.parse_args())))
