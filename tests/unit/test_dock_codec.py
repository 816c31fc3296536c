"""The dock's value encoding, layout and connection options (no servers)."""
import numpy as np
import pytest
import redis

from services.common.config import ConfigError, DockConfig, config_from_dict
from services.common.errors import FailedPrecondition, InvalidArgument
from services.dock import codec
from services.dock.client import redis_client, token_digest
from services.dock.schema import DEFAULT_COLUMNS, ColumnSpec, DockLayout, Keys


@pytest.mark.parametrize("value, dtype", [
    (np.arange(12, dtype=np.float32).reshape(3, 4), "float32"),
    (np.array([1, -2, 2**40], dtype=np.int64), "int64"),
    (np.array(7, dtype=np.int32), "int32"),
    (np.zeros(0, dtype=np.int32), "int32"),
    (np.array([True, False]), "bool"),
    (np.array([0.5, 1.5], dtype=np.float16), "float16"),
    (np.arange(10, dtype=np.float64)[::2], "float64"),  # not contiguous
])
def test_arrays_round_trip_with_dtype_and_shape(value, dtype):
    back = codec.decode(codec.encode(codec.to_array(value, dtype, "x")))
    assert back.dtype == np.dtype(dtype) and back.shape == value.shape
    np.testing.assert_array_equal(back, value)


def test_python_lists_and_strings_round_trip():
    assert codec.decode(codec.encode(codec.to_array([3, 4, 5], "int32", "x"))).tolist() == [3, 4, 5]
    assert codec.decode(codec.encode(codec.to_array(2.5, "float32", "x"))).item() == 2.5
    assert codec.decode(codec.encode(codec.to_array("x = 4 ✓", "utf8", "x"))) == "x = 4 ✓"


def test_encoding_is_header_plus_raw_bytes_not_pickle():
    blob = codec.encode(np.array([1, 2], dtype=np.int32))
    assert blob == bytes((codec.DTYPE_CODES["int32"], 1)) + (2).to_bytes(4, "little") + np.array([1, 2], "<i4").tobytes()


@pytest.mark.parametrize("value, dtype, match", [
    ([1.5, 2.0], "int32", "kind float64 cannot be stored in a int32 column"),
    ([2**40], "int32", "cannot be stored as int32"),
    (np.zeros(2), "float32", "dtype float64 does not match the column's dtype float32"),
    ("text", "int32", "got a str"),
    ([1, 2], "utf8", "expected a str"),
])
def test_bad_values_name_the_field_and_the_problem(value, dtype, match):
    with pytest.raises(InvalidArgument, match=match) as info:
        codec.to_array(value, dtype, "columns.prompts[3]")
    assert str(info.value).startswith("columns.prompts[3]: ")


@pytest.mark.parametrize("values, dtype, shape", [
    ([np.arange(5, dtype=np.int32), np.zeros(0, np.int32), np.arange(9, dtype=np.int32)[::3]], "int32", (None,)),
    ([np.zeros((3, 2, 4), np.uint8), np.zeros((2, 2), np.uint8)], "uint8", (None, None, None)),
    ([np.array([1.0], ">f4"), np.zeros(2, np.float32)], "float32", (None,)),  # big-endian: the checked path refuses it
    ([np.zeros(2, np.int32), np.zeros(3, np.int32)], "int32", (2,)),  # a fixed extent: the checked path checks it
    ([0, -7, 2**31 - 1, -2**31, 2**31, True, 1.5, np.int32(4)], "int32", ()),
    ([2**62, -3, 2**63], "int64", ()),
    ([0.1, 1e-40, float("inf"), float("nan"), 3.4e38, 1e300, 3, True], "float32", ()),
    ([0.1, 1e300, 2], "float64", ()),
    (["", "x = 4 ✓", 5], "utf8", ()),
])
@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # 1e300 into float32: numpy gives inf, as before
def test_a_columns_fast_encoding_matches_the_checked_path(values, dtype, shape):
    spec = ColumnSpec("c", dtype, shape)

    def checked(i, value):
        array = codec.to_array(value, dtype, f"columns.c[{i}]")
        if not isinstance(array, str):
            spec.check_shape(array.shape, f"columns.c[{i}]")
        return codec.encode(array)

    expected = []
    for i, value in enumerate(values):
        try:
            expected.append(checked(i, value))
        except InvalidArgument as exc:
            expected.append(str(exc))

    def refusing(i, value):
        try:
            return checked(i, value)
        except InvalidArgument as exc:
            return str(exc)

    assert codec.encode_column(values, dtype, shape, refusing) == expected


def test_decode_refuses_bytes_that_are_not_a_dock_value():
    with pytest.raises(ValueError, match="not a dock value"):
        codec.decode(b"\x80\x04\x95")  # the start of a pickle


def test_column_shape_check():
    spec = ColumnSpec("responses", "int32", (None,))
    spec.check_shape((17,), "x")
    with pytest.raises(InvalidArgument, match=r"shape \(2, 3\) does not fit the column's per-row shape \[\*\]"):
        spec.check_shape((2, 3), "x")
    with pytest.raises(InvalidArgument, match=r"shape \(5,\) does not fit .* \[4\]"):
        ColumnSpec("emb", "float32", (4,)).check_shape((5,), "x")


def test_layout_round_trips_through_json_and_validates():
    layout = DockLayout(n_samples_per_prompt=4, capacity_groups=8, partial_rollout_max_split=2)
    assert DockLayout.from_json(layout.to_json()) == layout
    assert layout.capacity_rows == 32 and layout.columns == DEFAULT_COLUMNS
    with pytest.raises(InvalidArgument, match="unknown column 'bogus'"):
        layout.column("bogus")
    with pytest.raises(InvalidArgument, match="duplicate column names"):
        DockLayout(1, 1, columns=(ColumnSpec("a", "int32"), ColumnSpec("a", "int32")), completion_column="a")
    with pytest.raises(InvalidArgument, match="'complex64' is not one of"):
        DockLayout(1, 1, columns=(ColumnSpec("a", "complex64"),), completion_column="a")


def test_layout_from_config_leaves_room_for_partial_rollout():
    base = {"megatron_training": {"global_batch_size": 8}, "rl_config": {"n_samples_per_prompt": 4}}
    assert DockLayout.from_config(config_from_dict(base)).capacity_groups == 8
    partial = config_from_dict({**base, "rl_config": {"n_samples_per_prompt": 4, "partial_rollout_max_split": 2}})
    assert DockLayout.from_config(partial).capacity_groups == 16
    # Asynchronous (max_staleness eta): the trainer admits (eta + 1) * GBS groups ahead, plus the carry-over.
    ahead = config_from_dict({**base, "rl_config": {"n_samples_per_prompt": 4, "max_staleness": 2}})
    assert DockLayout.from_config(ahead).capacity_groups == 24
    ahead_partial = config_from_dict({**base, "rl_config": {"n_samples_per_prompt": 4, "max_staleness": 1, "partial_rollout_max_split": 2}})
    assert DockLayout.from_config(ahead_partial).capacity_groups == 24
    sized = config_from_dict({**base, "dock": {"capacity_groups": 12}})
    assert DockLayout.from_config(sized).capacity_groups == 12
    layout = DockLayout.from_config(config_from_dict({**base, "rl_config": {"n_samples_per_prompt": 4, "actor_rollout_dispatch_size": 8}}))
    assert layout.dispatch_sizes == {"actor_rollout": 8, "rule_reward": 32, "model_reward": 32}  # reward: GBS * n
    assert DockLayout.from_json(layout.to_json()) == layout


def test_config_rejects_bad_dock_keys():
    with pytest.raises(ConfigError, match=r"dock.capacity_groups: 4 < \(rl_config.max_staleness \+ 1\) \* megatron_training.global_batch_size = 8"):
        config_from_dict({"megatron_training": {"global_batch_size": 8}, "dock": {"capacity_groups": 4}})
    with pytest.raises(ConfigError, match=r"dock.capacity_groups: 12 < .* = 16; the pool must hold the groups the trainer admits"):
        config_from_dict({"megatron_training": {"global_batch_size": 8}, "rl_config": {"max_staleness": 1}, "dock": {"capacity_groups": 12}})
    with pytest.raises(ConfigError, match="dock.run_id: 'a:b' must be non-empty without ':'"):
        config_from_dict({"dock": {"run_id": "a:b"}})


def test_keys_live_under_prefix_and_run_id():
    keys = Keys("dockrl", "exp1")
    # {exp1}: the run's Redis Cluster hash tag, so all its keys share one slot
    assert keys.meta == "dockrl:{exp1}:meta" and keys.value("responses", 7) == "dockrl:{exp1}:val:responses:7"
    with pytest.raises(InvalidArgument, match="run_id"):
        Keys("dockrl", "a:b")
    with pytest.raises(InvalidArgument, match="prefix"):
        Keys("dock{rl}", "exp1")  # a brace would move the hash tag


def test_client_honours_password_user_tls_and_ca():
    cfg = DockConfig(redis_url="redis://10.0.0.5:6380/2", redis_password="pw", redis_username="trainer",
                     redis_tls=True, redis_tls_ca_file="/etc/ca.pem", socket_timeout_s=3.0)
    pool = redis_client(cfg).connection_pool
    kwargs = pool.connection_kwargs
    assert issubclass(pool.connection_class, redis.SSLConnection)
    assert (kwargs["host"], kwargs["port"], kwargs["db"]) == ("10.0.0.5", 6380, 2)
    assert (kwargs["password"], kwargs["username"], kwargs["ssl_ca_certs"], kwargs["socket_timeout"]) == ("pw", "trainer", "/etc/ca.pem", 3.0)
    plain = redis_client(DockConfig(redis_url="redis://127.0.0.1:6379/0")).connection_pool
    assert not issubclass(plain.connection_class, redis.SSLConnection) and "password" not in plain.connection_kwargs
    with pytest.raises(FailedPrecondition, match="dock.redis_url is empty"):
        redis_client(DockConfig())


def test_token_digest_hides_the_token():
    assert token_digest("") == "" and token_digest("s3cret") != "s3cret" and len(token_digest("s3cret")) == 64
