"""What the last ``restore()`` loaded (:class:`RestoreReport`): ``Checkpointer.last_restore``,
read by the adapters' resume message."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RestoreReport:
    """What the last ``restore()`` loaded, for the adapters' resume message: the checkpoint
    (``path``, ``step``), its tier (``"local"``, or ``"remote"`` when it was downloaded from
    ``remote_url``), and each newer checkpoint skipped on the way, with why."""

    path: str
    step: int
    tier: str
    remote_url: str | None = None
    skipped: tuple[str, ...] = ()
    downloaded_files: int = 0  # node-local mode: files this node fetched (remote or peer)
    downloaded_bytes: int = 0

    def describe(self, where: str) -> str:
        """``resumed at step N (where) from PATH (local copy)[; skipped newer ...]``"""
        tier = {
            "remote": f"remote copy {self.remote_url}, downloaded",
            "peer": "this node's replica on a peer node, copied",
        }.get(self.tier, "local copy")
        msg = f"resumed at step {self.step} ({where}) from {self.path} ({tier})"
        if self.skipped:
            msg += "; skipped newer checkpoint(s): " + "; ".join(self.skipped)
        return msg
