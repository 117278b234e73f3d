"""The directory of a Checkpointer, opened at construction: one that every rank shares
(:class:`.directory.Directory`), or in node-local mode each node's own
(:class:`.nodelocal.NodeDirectory`, which needs a remote tier); the options that do not fit the
mode chosen are refused here. Every rank calls :func:`open_directory` (a collective: see
:mod:`.nodelocal` for which ranks do what in node-local mode).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .directory import Directory
from .errors import ConfigError
from .nodelocal import NodeDirectory
from .topology import Topology

if TYPE_CHECKING:
    from .config import CheckpointerConfig
    from .retention import RetentionPolicy


def open_directory(
    config: CheckpointerConfig, topology: Topology, retention: RetentionPolicy, world_size: int
) -> Directory:
    """Every rank, at construction: the directory of a Checkpointer, opened (a collective): one
    that every rank shares, or in node-local mode each node's own (which needs a remote tier)."""
    dirpath = config.dirpath
    d: Directory
    if topology.node_local:
        paths = topology.extra.get("dirpaths")
        if config.remote is None and paths:
            raise ConfigError(
                "the ranks were given different dirpaths ("
                + ", ".join(f"rank {r} {p!r}" for r, p in enumerate(paths))
                + "), so each sees a directory of its own: every rank must pass the same "
                "dirpath, on a filesystem they share (a per-rank path such as "
                "f'ckpt/{rank}' would split each checkpoint into parts no rank restores alone)"
            )
        if config.remote is None:
            raise ConfigError(
                f"dirpath={dirpath!r} is node-local ({len(topology.nodes)} nodes each see "
                "their own directory): node-local mode needs a durable remote tier that every "
                "node reaches, remote='s3://bucket/prefix' (or any fsspec URL); or put dirpath "
                "on a filesystem every node shares (docs/multinode.md)"
            )
        if config.incremental:
            raise ConfigError(
                "incremental=True is not supported yet in node-local mode (each node its own "
                "dirpath): a node's uploads do not carry the run's shared blob store. Use "
                "incremental=False there, or a dirpath every node shares "
                "(docs/multinode.md, docs/incremental.md)"
            )
        d = NodeDirectory(dirpath, retention, world_size, topology, config)
    else:
        if config.replicas:
            raise ConfigError(
                "replicas=1 applies when each node has its own dirpath (node-local mode); "
                f"every rank sees the same {dirpath!r} (one node, or a filesystem every node "
                "shares), so there is no other node's disk to keep a copy on: drop replicas= "
                "for this run, or give each node a dirpath on its own disk (docs/multinode.md)"
            )
        d = Directory(dirpath, retention, world_size, read_only=config.read_only)
    try:
        d.open(config)
        return d
    except BaseException:  # (a Ctrl-C as it returns: no one else holds it to release it)
        (d.release if isinstance(d, NodeDirectory) else d.release_opened)()
        raise
