"""What the dock stores and where: column specs, the run's layout, and the Redis key names.

Every key of a run lives under `prefix:{run_id}:` so several runs share one Redis. The braces
are literal: a Redis Cluster hash tag, so every key of a run maps to one slot (each script stays
single-slot and atomic) and different runs spread over the cluster's nodes:

    meta              hash   layout (JSON), token digest, target, complete, requeued, retired, rounds (begin_iterations)
    val:{column}:{row} string encoded value (codec.py), written by the put script from its arguments
    ready:{column}    bitmap bit i set: row i's value of {column} is final
    live              bitmap bit i set: row i holds a sample of the current pool
    consumed:{name}   bitmap bit i set: consumer {name} has claimed row i
    lease:{name}      zset   row index -> lease deadline (ms since epoch, Redis clock)
    owner:{name}      hash   row index -> lease id of the claim that holds it
    age               zset   group id -> age (partial-rollout splits so far; group max)
    rowage            hash   row index -> partial-rollout splits of the row
    order             zset   group id -> rounds at its admission * groups + group id (claims take older rounds first)
    done              hash   group id -> rows whose completion column is final
    version           hash   row index -> policy version of the last put that named one
    consumers         set    consumer names seen (so clear knows every key)
    waiting           hash   consumer -> end of its claim's wait (ms), for consumers whose claim found too few rows
    wake:{name}       list   a token for a waiting consumer {name} once rows were put or released (its claim's BLPOP)
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from services.common.config import Config
from services.common.errors import InvalidArgument
from services.dock.codec import DTYPE_CODES


@dataclass(frozen=True)
class ColumnSpec:
    """One experience key: its dtype and its per-row shape (None: any length)."""

    name: str
    dtype: str
    shape: tuple[int | None, ...] = ()

    def check_shape(self, shape: tuple[int, ...], field: str) -> None:
        """Raises InvalidArgument unless `shape` fits this column's per-row shape."""
        if len(shape) != len(self.shape) or any(want is not None and want != got for want, got in zip(self.shape, shape)):
            raise InvalidArgument(field, f"shape {tuple(shape)} does not fit the column's per-row shape {self.shape_text}")

    @property
    def shape_text(self) -> str:
        return "[" + ", ".join("*" if d is None else str(d) for d in self.shape) + "]"


# MindSpeed-RL's experience keys; [*] is one entry per token (prompt or response). The only place a column's
# name is spelled: everything else names a column by these constants, and services/dock/rows.py converts the
# typed records of a row to and from them.
PROMPTS = ColumnSpec("prompts", "int32", (None,))  # [P] prompt token ids
PROMPT_LENGTH = ColumnSpec("prompt_length", "int32")  # []
LABELS = ColumnSpec("labels", "utf8")  # the reference answer the reward compares with
RESPONSES = ColumnSpec("responses", "int32", (None,))  # [L] response token ids (the completion column)
RESPONSE_LENGTH = ColumnSpec("response_length", "int32")  # []
ROLLOUT_LOG_PROBS = ColumnSpec("rollout_log_probs", "float32", (None,))  # [L] the rollout engine's log p
VERSIONS = ColumnSpec("versions", "int32", (None,))  # [L] policy version that generated each token
# [P+L-1, MoE layers, top_k] expert ids each computed position was routed to (rl_config.routing_replay; the last
# response token is never fed to the rollout model, so it has none): services/rollout/routing_recorder.py
ROUTED_EXPERTS = ColumnSpec("routed_experts", "uint8", (None, None, None))
# [L] 1 on the model's tokens, 0 on the tokens an environment added (multi-turn episodes: rollout.multi_turn; a
# layout holds it only then, so a single-turn run stores nothing new)
LOSS_MASK = ColumnSpec("loss_mask", "uint8", (None,))
# [K] what one episode did, in the fixed order of EPISODE_STATS_FIELDS (a layout holds it only with an environment,
# as loss_mask): the tool-call error kinds are those of services/rollout/agent/tool_environment.py, environment_s
# the seconds in the environment's reset and steps, environment_reward its reward summed over the turns. One
# column rather than one per field: one value per row to put and read, and a field added later is one name here.
EPISODE_STATS_FIELDS = ("turns", "tool_calls", "malformed_call", "unknown_tool", "tool_error", "tool_timeout",
                        "environment_s", "environment_reward")
TOOL_ERROR_FIELDS = ("malformed_call", "unknown_tool", "tool_error", "tool_timeout")  # summed: the failed calls
EPISODE_STATS = ColumnSpec("episode_stats", "float32", (None,))  # [K], K = len(EPISODE_STATS_FIELDS)
FINISH_REASON = ColumnSpec("finish_reason", "utf8")  # a FinishReason value: stop | length | abort | failed (services/common/sample.py)
RM_SCORES = ColumnSpec("rm_scores", "float32")  # [] reward of the whole response
RM_PARTS = ColumnSpec("rm_parts", "float32", (None,))  # [V] each verifier's score (rl_config.verifier_function order), before weighting
RM_MODEL = ColumnSpec("rm_model", "float32")  # [] the reward model's score, before weighting (from reward-model replicas, when they run apart)
DEFAULT_COLUMNS: tuple[ColumnSpec, ...] = (
    PROMPTS, PROMPT_LENGTH, LABELS, RESPONSES, RESPONSE_LENGTH, ROLLOUT_LOG_PROBS, VERSIONS, ROUTED_EXPERTS,
    FINISH_REASON, RM_SCORES, RM_PARTS, RM_MODEL,
)
# The trainer computes old and reference log-probs, values, returns and advantages on each iteration in
# its own processes (they never travel), so the pool holds no column for them; a layout may add columns.


# MindSpeed-RL's consumer names and the rl_config key that sizes each one's claims.
DISPATCH_SIZE_KEYS: dict[str, str] = {
    "actor_rollout": "actor_rollout_dispatch_size",
    "rule_reward": "reward_dispatch_size",
    "model_reward": "reward_dispatch_size",  # reward-model replicas, when they run apart from the rule ones
}
# The trainer's `actor_train` claims name their count: each iteration's GBS x n rows, in one claim.


@dataclass(frozen=True)
class DockLayout:
    """The shape of a run's pool, written once by the trainer (`Dock.create`) and read by every client."""

    n_samples_per_prompt: int
    capacity_groups: int  # group slots; rows are 0 .. capacity_groups * n - 1
    columns: tuple[ColumnSpec, ...] = DEFAULT_COLUMNS
    guarantee_order: bool = False
    partial_rollout_max_split: int = 1
    require_max_age_all_finished: bool = True
    rollout_consumer: str = "actor_rollout"  # the consumer partial rollout applies to
    completion_column: str = RESPONSES.name  # a group is complete when this is final on all n rows
    dispatch_sizes: dict[str, int] = field(default_factory=dict)  # consumer -> rows per claim when none given
    max_prompt_length: int = 0  # a put of a longer `prompts` value is refused (rl_config.max_prompt_length); 0: no limit

    def __post_init__(self):
        names = [c.name for c in self.columns]
        if len(set(names)) != len(names):
            raise InvalidArgument("columns", f"duplicate column names in {names}")
        if self.completion_column not in names:
            raise InvalidArgument("completion_column", f"{self.completion_column!r} is not one of the columns {names}")
        for column in self.columns:
            if column.dtype not in DTYPE_CODES:
                raise InvalidArgument(f"columns.{column.name}.dtype", f"{column.dtype!r} is not one of {', '.join(DTYPE_CODES)}")
        if self.n_samples_per_prompt < 1 or self.capacity_groups < 1:
            raise InvalidArgument("capacity_groups", "n_samples_per_prompt and capacity_groups must be >= 1")

    @property
    def capacity_rows(self) -> int:
        return self.capacity_groups * self.n_samples_per_prompt

    @property
    def partial_rollout(self) -> bool:
        return self.partial_rollout_max_split > 1

    def column(self, name: str, field: str = "columns") -> ColumnSpec:
        """The spec of column `name`; InvalidArgument naming the known columns when there is none."""
        for column in self.columns:
            if column.name == name:
                return column
        raise InvalidArgument(field, f"unknown column {name!r} (known: {', '.join(c.name for c in self.columns)})")

    def has(self, column: ColumnSpec) -> bool:
        """Whether this layout holds `column` (a layout may leave optional columns out)."""
        return any(c.name == column.name for c in self.columns)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> DockLayout:
        data = json.loads(text)
        data["columns"] = tuple(ColumnSpec(c["name"], c["dtype"], tuple(c["shape"])) for c in data["columns"])
        return cls(**data)

    @classmethod
    def from_config(cls, cfg: Config, columns: tuple[ColumnSpec, ...] = DEFAULT_COLUMNS) -> DockLayout:
        """The layout a run's config implies: room for the groups the trainer admits (Config.admitted_groups), and
        the loss mask and episode stats columns when rows run as multi-turn episodes."""
        rl = cfg.rl_config
        if cfg.rollout.multi_turn.environment:
            columns = (*columns, *(c for c in (LOSS_MASK, EPISODE_STATS) if c not in columns))
        return cls(
            n_samples_per_prompt=rl.n_samples_per_prompt,
            capacity_groups=cfg.dock.capacity_groups or cfg.admitted_groups,
            columns=columns,
            guarantee_order=rl.guarantee_order,
            partial_rollout_max_split=rl.partial_rollout_max_split,
            require_max_age_all_finished=rl.require_max_age_all_finished,
            rollout_consumer=cfg.dock.rollout_consumer,
            dispatch_sizes={consumer: getattr(rl, key) for consumer, key in DISPATCH_SIZE_KEYS.items()},
            max_prompt_length=rl.max_prompt_length,
        )


@dataclass(frozen=True)
class Keys:
    """Redis key names of one run."""

    prefix: str
    run_id: str
    base: str = field(init=False)

    def __post_init__(self):
        for name, value in (("prefix", self.prefix), ("run_id", self.run_id)):
            if not value or any(c in value for c in ":*{}"):
                raise InvalidArgument(name, f"{value!r} must be non-empty without ':', '*', '{{' or '}}'")
        # {run_id} is the Redis Cluster hash tag: all of a run's keys share its slot.
        object.__setattr__(self, "base", f"{self.prefix}:{{{self.run_id}}}:")

    @property
    def meta(self) -> str:
        return self.base + "meta"

    def value(self, column: str, row: int) -> str:
        return f"{self.base}val:{column}:{row}"

    @property
    def pattern(self) -> str:
        """A SCAN pattern matching every key of the run."""
        return self.base + "*"
