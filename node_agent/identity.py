"""The node's persisted identity (DATA_DIR/node.json).

The coordinator assigns the node id on the first registration; the agent keeps it so that a
restarted agent, or one whose lease lapsed, registers again as the same node.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

IDENTITY_FILE = "node.json"


def load_node_id(data_dir: Path) -> str:
    """The node id stored in DATA_DIR/node.json, or "" when there is none (or it is unreadable)."""
    path = data_dir / IDENTITY_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return ""
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable identity file %s: %s", path, exc)
        return ""
    node_id = data.get("node_id", "") if isinstance(data, dict) else ""
    if not isinstance(node_id, str):
        log.warning("ignoring identity file %s: node_id is not a string", path)
        return ""
    return node_id


def save_node_id(data_dir: Path, node_id: str) -> None:
    """Atomically write DATA_DIR/node.json (write to a temporary file, fsync, rename)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / IDENTITY_FILE
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w") as f:
        json.dump({"node_id": node_id}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
