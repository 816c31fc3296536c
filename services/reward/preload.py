"""Imported once by the verifier pool's forkserver: loads the verifiers and runs each once, so the
parsers' caches are warm in the forkserver and every worker forked from it starts warm."""
from services.reward.verifiers import REGISTRY, run_verifier

for _name in REGISTRY:
    run_verifier(_name, "<think>x</think><answer>\\boxed{\\frac{1}{2}}</answer>", "0.5")
