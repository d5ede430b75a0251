"""``ModelRecord`` <-> a row of ``model_versions`` joined with its ``models`` row (schema: database.py).

>>> rows = db.query(SELECT_VERSION + " WHERE v.name = ? ORDER BY v.version", (name,))
>>> [record_from_row(r) for r in rows]
>>> insert_version_row(conn, record)   # inside a write transaction
"""

from __future__ import annotations

import json
import sqlite3
from datetime import datetime
from typing import Any

from ntk_service.registry.records import InputSpec, ModelRecord, ParameterInfo

__all__ = ["SELECT_VERSION", "insert_version_row", "record_from_row"]

SELECT_VERSION = """
SELECT v.name, v.version, m.architecture, v.seed, v.num_params, v.input_shape, v.input_dtype, v.output_dim,
       v.parameters, v.weights_sha256, v.created_at, v.label, v.inputs, m.paths
FROM model_versions v JOIN models m ON m.name = v.name
"""
"""The columns ``record_from_row`` reads, in its order; callers add the WHERE and ORDER BY."""


def record_from_row(row: Any) -> ModelRecord:
    """The record of one ``SELECT_VERSION`` row."""
    return ModelRecord(
        name=row[0],
        version=row[1],
        architecture=json.loads(row[2]),
        seed=row[3],
        num_params=row[4],
        input_shape=tuple(json.loads(row[5])),
        input_dtype=row[6],
        output_dim=row[7],
        parameters=tuple(ParameterInfo(n, tuple(s)) for n, s in json.loads(row[8])),
        weights_sha256=row[9],
        created_at=datetime.fromisoformat(row[10]),
        label=row[11],
        inputs=None if row[12] is None else InputSpec.from_public(json.loads(row[12])),
        parameter_paths=None if row[13] is None else json.loads(row[13]),
    )


def insert_version_row(conn: sqlite3.Connection, record: ModelRecord) -> None:
    """Insert ``record`` as a ``model_versions`` row (its ``models`` row must exist)."""
    conn.execute(
        "INSERT INTO model_versions (name, version, seed, num_params, input_shape, input_dtype, output_dim, "
        "parameters, weights_sha256, created_at, label, inputs) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            record.name,
            record.version,
            record.seed,
            record.num_params,
            json.dumps(list(record.input_shape)),
            record.input_dtype,
            record.output_dim,
            json.dumps([[p.name, list(p.shape)] for p in record.parameters]),
            record.weights_sha256,
            record.created_at.isoformat(),
            record.label,
            None if record.inputs is None else json.dumps(record.inputs.to_public()),
        ),
    )
