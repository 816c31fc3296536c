"""python -m services.trainer: the trainer's command line."""
import argparse
import sys

from services.common.config import exit_status
from services.trainer import cli

parser = argparse.ArgumentParser(prog="dockrl trainer", description="dockrl Megatron trainer")
cli.add_arguments(parser)
sys.exit(exit_status(lambda: cli.run(parser.parse_args())))
