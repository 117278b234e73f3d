"""Which ranks share a disk: detection at construction (node-local mode, docs/multinode.md).

Each rank writes a probe file named after a token rank 0 chose; once every rank has written its
probe (an all-gather of the write errors) every rank lists ``dirpath`` and learns which ranks'
probes it sees. The ranks that see each other's probes share
a disk: a *node* (a storage domain). One node holding every rank is the shared mode of before
(nothing changes); several nodes are node-local mode (:mod:`.nodelocal`), for which
:func:`detect` also creates the gloo groups the protocol uses (each node, the node leaders, all
ranks). ``shared_dirpath=True`` skips the probe, ``False`` requires node-local disks.

Which ranks call what: :func:`detect` is a collective of every rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from . import dist
from .errors import CheckpointWriteError, ConfigError
from .filewrite import write_bytes

log = logging.getLogger("resilient_callbacks")

PROBE_PREFIX = ".rc-node-probe-"


@dataclass
class Topology:
    """Which ranks share a disk. ``nodes``: the ranks of each node, nodes ordered by their
    lowest rank. The groups (gloo) exist only in node-local mode."""

    rank: int
    world_size: int
    nodes: tuple[tuple[int, ...], ...]
    node_group: Any = None
    leaders_group: Any = None
    cpu_group: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def node_local(self) -> bool:
        return len(self.nodes) > 1

    @property
    def node(self) -> int:
        return self.node_of(self.rank)

    def node_of(self, rank: int) -> int:
        for i, ranks in enumerate(self.nodes):
            if rank in ranks:
                return i
        raise ValueError(f"rank {rank} is on no node")

    @property
    def node_ranks(self) -> tuple[int, ...]:
        return self.nodes[self.node]

    @property
    def leader(self) -> int:
        return self.node_ranks[0]

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    @property
    def leaders(self) -> list[int]:
        return [n[0] for n in self.nodes]

    def successor(self, node: int) -> int:
        return (node + 1) % len(self.nodes)

    def predecessor(self, node: int) -> int:
        return (node - 1) % len(self.nodes)

    @staticmethod
    def label(ranks: tuple[int, ...] | list[int]) -> str:
        """A node's name on disk (replica folders): its ranks."""
        return f"ranks_{min(ranks):05d}-{max(ranks):05d}"


def detect(dirpath: str, shared: bool | None) -> Topology:
    """Every rank, at construction: which ranks see the same ``dirpath`` (see the module
    docstring). Raises :class:`ConfigError` when ``shared=False`` but every rank sees one
    directory, or when the visibility is not a partition of the ranks."""
    r, n = dist.rank(), dist.world_size()
    if n == 1 or shared is True:
        return Topology(r, n, (tuple(range(n)),))
    token = dist.broadcast_json(uuid.uuid4().hex[:12] if r == 0 else None)
    prefix = f"{PROBE_PREFIX}{token}-"
    probe = os.path.join(dirpath, f"{prefix}{r:05d}")
    error = None
    try:
        os.makedirs(dirpath, exist_ok=True)
        write_bytes(probe, b"")
    except OSError as e:
        error = f"rank {r}: cannot write into {dirpath}: {e}"
    # an all-gather returns on a rank only once every rank entered it: every probe is written
    errors = [e for e in dist.all_gather_json(error) if e]
    if errors:
        raise CheckpointWriteError("; ".join(errors) + ". Check the path and its permissions.")
    seen: set[int] = set()
    for attempt in range(2):
        if attempt:
            if len(seen) == n:
                break  # every rank's probe is here: one shared directory, nothing to wait for
            time.sleep(0.2)  # a second look: network filesystems may list a new file late
        for name in os.listdir(dirpath):
            if name.startswith(prefix):
                with contextlib.suppress(ValueError):
                    seen.add(int(name[len(prefix) :]))
    view = [min(seen), len(seen), hash(tuple(sorted(seen))) & 0xFFFFFFFF, dirpath]
    views = dist.all_gather_json(view)  # (every rank has listed: the probes may go)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    groups: dict[int, list[int]] = {}
    for rank_, (first, *_) in enumerate(views):
        groups.setdefault(first, []).append(rank_)
    for ranks in groups.values():
        if any(views[x][1] != len(ranks) or views[x][2] != views[ranks[0]][2] for x in ranks):
            raise ConfigError(
                f"dirpath={dirpath!r}: the ranks disagree about who shares this directory "
                f"(visible probe files per rank: {views}); it must be either one filesystem "
                "all ranks share or one disk per node. Pass shared_dirpath=True or False."
            )
    nodes = tuple(tuple(v) for _, v in sorted(groups.items()))
    if len(nodes) == 1:
        if shared is False:
            raise ConfigError(
                f"shared_dirpath=False, but every rank sees the same dirpath={dirpath!r} (a "
                "shared filesystem): node-local mode needs a directory of its own per node. "
                "Drop shared_dirpath (detected) or give each node a local path."
            )
        return Topology(r, n, nodes)
    topo = Topology(r, n, nodes)
    if len({v[3] for v in views}) > 1:  # (a per-rank path: f"ckpt/{rank}")
        topo.extra["dirpaths"] = [v[3] for v in views]
    import torch.distributed as tdist

    # the world's timeout, not gloo's 30-minute default: a world set to wait 2 hours for slow
    # saves had its node exchanges fail after 30 minutes, one set to 60 s hung there 30 minutes
    timeout = dist.world_timeout()
    for node_ranks in nodes:  # every rank creates every group, in the same order
        g = tdist.new_group(list(node_ranks), backend="gloo", timeout=timeout)
        if r in node_ranks:
            topo.node_group = g
    topo.leaders_group = tdist.new_group(topo.leaders, backend="gloo", timeout=timeout)
    topo.cpu_group = tdist.new_group(backend="gloo", timeout=timeout)
    log.info(
        "node-local mode: %d nodes (%s) each with its own %s",
        len(nodes),
        ", ".join(Topology.label(x) for x in nodes),
        dirpath,
    )
    return topo
