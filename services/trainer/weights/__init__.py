"""Weight sync to the rollout replicas: gather to HF names, pack buckets, push over gRPC, track which replicas are stale."""
