"""A whole GRPO run through `dockrl up` with the dock on a three-master Redis Cluster: the user changes
two config keys (dock.redis_url, dock.redis_cluster) and nothing else."""
import pytest
import redis

from tests.e2e.conftest import resolved_config, steps

pytestmark = [pytest.mark.service, pytest.mark.slow]

ITERS = 4


def test_a_run_on_a_redis_cluster_trains_every_sample_once_with_its_keys_in_one_slot(run_up, redis_cluster_url):
    metrics, summary, log_dir = run_up(f"dock.redis_url={redis_cluster_url}", "dock.redis_cluster=true", "dock.run_id=on-cluster",
                                       f"megatron_training.train_iters={ITERS}", "trainer.eval_data_path=", "trainer.test_data_path=")
    records = steps(metrics)
    assert [r["step"] for r in records] == list(range(1, ITERS + 1))
    cfg = resolved_config(log_dir)
    assert cfg["dock"]["redis_url"] == redis_cluster_url  # `dockrl up` started no Redis of its own
    gbs, n = cfg["megatron_training"]["global_batch_size"], cfg["rl_config"]["n_samples_per_prompt"]
    acc = summary["accounting"]
    assert acc["rows_put"] == acc["rows_trained"] == ITERS * gbs * n and acc["rows_dropped"] == 0
    assert max(r["train_rollout_logprob_diff"] for r in records) < 1e-3
    # The run's keys (the dock, the replica registry) live in the cluster, all in one hash slot.
    cluster = redis.RedisCluster.from_url(redis_cluster_url)
    try:
        keys = [key.decode() for node in cluster.get_primaries()
                for key in cluster.get_redis_connection(node).scan_iter("*on-cluster*")]
        assert keys, "no key of the run in the cluster"
        assert len({cluster.keyslot(key) for key in keys}) == 1, keys
    finally:
        cluster.close()
