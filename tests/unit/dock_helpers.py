"""Dock rows as a claim reads them back, for tests of the typed records (services/dock/rows.py) without a server."""
from __future__ import annotations

from services.dock import codec
from services.dock.client import Claim, Lease
from services.dock.schema import DEFAULT_COLUMNS, EPISODE_STATS, LOSS_MASK

SPECS = {c.name: c for c in (*DEFAULT_COLUMNS, LOSS_MASK, EPISODE_STATS)}


def stored_columns(columns: dict) -> dict[str, list]:
    """`columns` as a claim reads them back: each value encoded and decoded as the dock does (a value that would
    take the codec's slower checked path fails the test: every record's put must take the fast one)."""
    def refuse(i, value):
        raise AssertionError(f"value {i} ({value!r}) took the checked path")

    out = {}
    for name, values in columns.items():
        spec = SPECS[name]
        blobs = codec.encode_column([codec.to_array(v, spec.dtype, name) for v in values], spec.dtype, spec.shape, refuse)
        out[name] = [codec.decode(b) for b in blobs]
    return out


def claim_of(columns: dict[str, list]) -> Claim:
    """A claim holding `columns` as given, its rows numbered from 0."""
    rows = len(next(iter(columns.values())))
    return Claim(Lease("test", "lease", 0), list(range(rows)), [0] * rows, columns)


def stored_claim(*puts: dict) -> Claim:
    """A claim of the rows `puts` wrote, every column of theirs taken, as the dock stores them."""
    return claim_of({name: values for put in puts for name, values in stored_columns(put).items()})
