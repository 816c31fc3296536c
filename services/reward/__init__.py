"""The rule-reward service: verifiers, a timeout-bounded process pool, a gRPC API and a dock worker."""
