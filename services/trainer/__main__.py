"""python -m services.trainer: the trainer's command line."""
import argparse
import sys

from services.trainer import cli

parser = argparse.ArgumentParser(prog="dockrl trainer", description="dockrl Megatron trainer")
cli.add_arguments(parser)
sys.exit(cli.run(parser.parse_args()))
