"""``python -m resilient_callbacks.deepspeed.run SCRIPT [ARGS...]``: run SCRIPT as ``__main__``
with ``deepspeed.initialize`` made resilient (see :mod:`.launch`). Works as
``deepspeed --module resilient_callbacks.deepspeed.run SCRIPT ...`` and under ``torchrun``.

The ``deepspeed`` launcher puts ``--local_rank=N`` before the module's arguments, that is before
SCRIPT: it is handed to SCRIPT first among its arguments, as ``deepspeed SCRIPT ...`` would.

Started on its own (``python -m resilient_callbacks.deepspeed.run SCRIPT``: none of ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, no MPI launcher), SCRIPT
runs as the only rank: those five are set for one process when DeepSpeed's ``init_distributed``
is called with no process group (it looked for MPI otherwise and failed without ``mpi4py``).
Not at the start: a trainer that starts its ranks itself (Lightning's ``Trainer(devices=2)``)
takes a ``LOCAL_RANK`` it did not set for a launcher's, and started no other rank.

When SCRIPT ends normally (returns, or exits with status 0), each engine's last step is saved
(unless it already is) and its pending saves are committed: re-running a finished job then
restores its end and trains nothing, and ``resilient-ckpt export`` exports the final weights.
When SCRIPT raises, each engine does what ``save_on_exception`` says (see
``Checkpointer.abort``) and the exception goes on."""

from __future__ import annotations

import logging
import os
import re
import runpy
import socket
import sys
from collections.abc import Mapping, MutableMapping

log = logging.getLogger("resilient_callbacks")


def _usage() -> str:
    """The module docstring as plain text for a terminal: ``code`` marks and roles removed."""
    text = re.sub(r":[a-z]+:`[.~]?([^`]+)`", r"\1", __doc__ or "")
    return text.replace("``", "").strip()


#: what torch.distributed's env:// rendezvous (and DeepSpeed's init_distributed) reads
RENDEZVOUS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: set by MPI launchers (mpirun, srun with PMI): DeepSpeed's MPI discovery finds the ranks there
_MPI = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")
#: set by HPE Cray's launchers in each process they start, its rank, where cray-pmi may set none
#: of the above (and no number of processes): aprun (ALPS) and PALS's mpiexec; Slurm on a Cray
#: sets them in a step's tasks too, whose number SLURM_NTASKS then says. Each with the launcher
#: it names in an error and the command that starts one process without it.
_CRAY_RANKS = {
    "ALPS_APP_PE": ("Cray's aprun", "aprun -n 1", "without aprun"),
    "PALS_RANKID": ("HPE Cray PALS's mpiexec", "mpiexec -n 1", "without mpiexec"),
}


def single_process_env(environ: MutableMapping[str, str]) -> bool:
    """Set :data:`RENDEZVOUS` in ``environ`` for one process (rank 0 of 1, a free local port)
    where none of them is set and nothing says other processes run beside this one (an MPI
    launcher's variables, a Slurm step of several tasks, Cray's ``aprun`` or PALS's
    ``mpiexec`` outside Slurm: ``ALPS_APP_PE``, ``PALS_RANKID``, which say no number of
    processes, so ``aprun -n 1`` too is left to DeepSpeed's MPI discovery); whether it did.
    Without them ``deepspeed.init_distributed`` turns to MPI discovery and fails without
    ``mpi4py`` (``ModuleNotFoundError: No module named 'mpi4py'``), also for one process."""
    if any(k in environ for k in (*RENDEZVOUS, *_MPI)):
        return False
    if environ.get("SLURM_NTASKS", "1") != "1":
        return False
    if _cray_launcher(environ):
        return False
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    log.info(
        "resilient_callbacks.deepspeed.run: none of %s is set and no launcher started this "
        "process: it runs as the only rank (MASTER_PORT=%d). For several ranks, start it with "
        "torchrun or deepspeed --module",
        ", ".join(RENDEZVOUS),
        port,
    )
    return True


def _cray_launcher(environ: Mapping[str, str]) -> str | None:
    """The rank variable of :data:`_CRAY_RANKS` by which Cray's ``aprun`` or PALS's
    ``mpiexec`` started this process outside a Slurm job, having set nothing DeepSpeed finds
    its ranks by but through MPI (the rank alone: ``aprun -n 1`` looks like rank 0 of
    several); None where none did."""
    if any(k in environ for k in ("SLURM_JOB_ID", "SLURM_JOBID", *RENDEZVOUS, *_MPI)):
        return None
    return next((k for k in _CRAY_RANKS if k in environ), None)


def _cray_needs_mpi4py(environ: Mapping[str, str], var: str) -> str:
    """What DeepSpeed's ``No module named 'mpi4py'`` means where :func:`_cray_launcher` found
    ``var``."""
    launcher, one, alone = _CRAY_RANKS[var]
    return (
        f"No module named 'mpi4py': {launcher} started this process ({var}="
        f"{environ.get(var)}) and none of {', '.join((*RENDEZVOUS, *_MPI))} is set, so "
        "DeepSpeed looks for its ranks through MPI, which needs mpi4py: install it (built "
        "against the system's MPI), or load cray-pmi so that PMI_RANK and PMI_SIZE are set. "
        f"{launcher.split()[-1]} says no number of processes, so `{one}` cannot be told from "
        f"rank 0 of several: for one process, start it {alone}, or set RANK=0 LOCAL_RANK=0 "
        "WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=<a free port>"
    )


def single_process_at_init() -> None:
    """Make DeepSpeed's ``init_distributed`` (``deepspeed.init_distributed``, the
    ``deepspeed.comm`` one that ``deepspeed.initialize`` and ``zero.Init`` call) run
    :func:`single_process_env` first when no process group exists. At the call, not when SCRIPT
    starts: set at the start, ``LOCAL_RANK`` told Lightning's ``Trainer(devices=2)`` with
    ``DeepSpeedStrategy`` that a launcher had started its ranks, so it started none and rank 0
    waited for rank 1 until the rendezvous timed out. (Lightning, like the launchers, sets the
    five itself before it calls ``init_distributed``: they are then left as they are.)"""
    import deepspeed.comm.comm as ds_comm
    import torch.distributed as tdist

    original = ds_comm.init_distributed

    def init_distributed(*args: object, **kwargs: object) -> object:
        cray: str | None = None
        if not (tdist.is_available() and tdist.is_initialized()):
            cray = None if single_process_env(os.environ) else _cray_launcher(os.environ)
        try:
            return original(*args, **kwargs)
        except ModuleNotFoundError as e:  # (aprun -n 1 without mpi4py ran alone before)
            if cray and e.name == "mpi4py":
                raise ModuleNotFoundError(_cray_needs_mpi4py(os.environ, cray), name=e.name) from e
            raise

    init_distributed.__doc__ = original.__doc__
    for name, module in list(sys.modules.items()):  # (and later imports take comm.comm's)
        if name.split(".")[0] == "deepspeed" and getattr(module, "init_distributed", 0) is original:
            module.init_distributed = init_distributed  # type: ignore[attr-defined]


def split_argv(argv: list[str]) -> tuple[str, list[str]]:
    """SCRIPT and the arguments it sees: any ``--local_rank=N`` / ``--local_rank N`` the
    ``deepspeed`` launcher put before SCRIPT moves after it. Raises SystemExit(2) when there
    is no SCRIPT."""
    moved: list[str] = []
    i = 0
    while i < len(argv) and argv[i].startswith("--local_rank"):
        if argv[i] == "--local_rank" and i + 1 < len(argv):
            moved += argv[i : i + 2]
            i += 2
        else:
            moved.append(argv[i])
            i += 1
    if i >= len(argv):
        print(_usage(), file=sys.stderr)
        raise SystemExit(2)
    return argv[i], [argv[i], *moved, *argv[i + 1 :]]


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(_usage())
        raise SystemExit(0)
    script, script_argv = split_argv(argv)
    if not os.path.isfile(script):
        print(f"resilient_callbacks.deepspeed.run: no such script: {script}", file=sys.stderr)
        raise SystemExit(2)
    from .launch import patch

    patch()
    single_process_at_init()
    sys.argv = script_argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):  # a failure (or a preemption's 75) is not the end
            raise
        finish()
        raise
    except BaseException as e:  # the script failed: save_on_exception's save, then it goes on
        abort_all(e)
        raise
    finish()


def abort_all(exc: BaseException) -> None:
    """Every rank, after SCRIPT raised ``exc``: each engine's ``save_on_exception`` save (on
    one rank), then close."""
    from .launch import handles

    for handle in handles():
        if not handle.checkpointer.closed:
            handle.abort(exc)


def finish() -> None:
    """Every rank, after SCRIPT returned: save each engine's last step, then close."""
    import torch.distributed as tdist

    from .launch import handles

    for handle in handles():
        ckpt = handle.checkpointer
        if ckpt.closed:
            continue
        try:
            if tdist.is_available() and not tdist.is_initialized() and ckpt.world_size > 1:
                log.warning(
                    "the script destroyed the process group before it ended: step %d is not "
                    "saved at the end (the newest checkpoint is %s)",
                    handle.engine.global_steps,
                    ckpt.latest_path,
                )
            else:
                handle.save(final=True)  # saved already: nothing new, but uploaded
        finally:
            handle.close()


if __name__ == "__main__":
    main()
