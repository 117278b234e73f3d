"""What a new user meets first with resilient-ckpt (found by a first-contact walk, 2026-12-07):
a typo in a URL's scheme, a store that needs credentials none were given for, a store that does
not answer (and one that answers a long listing: not said to give no answer), report's usage
line, push's line about a copy already there. Each says what it did or what to do, in one line."""

from __future__ import annotations

import contextlib
import io
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

from resilient_callbacks.cli_format import DIR_HELP
from resilient_callbacks.errors import RemoteUnavailableError
from resilient_callbacks.remote import RemoteStore
from test_cli import cli, make_run


def test_an_unknown_url_scheme_says_how_to_fix_it(tmp_path):
    """``s4://`` (a typo) said only fsspec's "Protocol not known: s4", and exited 1 as a store
    that failed does. A usage error (2) naming the scheme, the one nearest it, and the schemes
    installed here and known to fsspec."""
    root = str(tmp_path / "ck")
    make_run(root, steps=(10,))
    for args in (
        ["verify", "s4://bucket/run1"],
        ["ls", root, "--remote", "s4://bucket/run1"],
        ["pull", "s4://bucket/run1", str(tmp_path / "pulled")],
        ["push", root, "simplecache::s4://bucket/run1"],
    ):
        r = cli(*args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
        said = "'s4://' is no scheme fsspec knows (did you mean s3://?): check its spelling"
        assert said in r.stderr, r.stderr
        assert "Installed here: " in r.stderr and " file, " in r.stderr, r.stderr
    with pytest.raises(
        RemoteUnavailableError, match=re.escape("Protocol not known: s4. 's4://' is no")
    ):
        RemoteStore("s4://bucket/run1")


def test_a_store_without_credentials_says_where_to_give_them(tmp_path):
    """``s3://`` with no credentials anywhere: botocore's "Unable to locate credentials" was
    the whole line. A real run of the executable, the environment holding none (the endpoint
    is a closed local port: the client fails before it connects)."""
    pytest.importorskip("s3fs")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    nowhere = str(tmp_path / "none")
    env |= {
        "AWS_SHARED_CREDENTIALS_FILE": nowhere,
        "AWS_CONFIG_FILE": nowhere,
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    endpoint = "endpoint_url=http://127.0.0.1:9"
    r = subprocess.run(
        [sys.executable, "-m", "resilient_callbacks", "verify", "s3://bucket/run1", "-o", endpoint],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 1, r.stderr
    assert "NoCredentialsError" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "AWS_ACCESS_KEY_ID" in r.stderr and "-o anon=true" in r.stderr, r.stderr


def test_report_usage_names_dir_as_required():
    """``report --help`` showed ``[DIR]`` (optional to argparse only, for ``report --json
    DIR``) while a report without DIR is a usage error."""
    shown = cli("report", "--help")
    assert shown.returncode == 0
    usage = shown.stdout.split("\n\n")[0]
    assert usage.rstrip().endswith(" DIR") and "[DIR]" not in usage, usage
    missing = cli("report")
    assert missing.returncode == 2 and "required: DIR" in missing.stderr, missing.stderr


def test_push_says_how_a_copy_already_there_was_checked(tmp_path):
    """A checkpoint the store holds printed the same line with and without --verify: whether
    its checksums were read was not said (only --json's "checked" told)."""
    root = str(tmp_path / "ck")
    make_run(root, steps=(10,))
    url = (tmp_path / "remote").as_uri()
    assert cli("push", root, url).returncode == 0
    again = cli("push", root, url)
    assert again.returncode == 0 and again.stdout.strip().endswith("(sizes match)"), again.stdout
    read = cli("push", root, url, "--verify")
    assert read.returncode == 0, read.stderr
    assert read.stdout.strip().endswith("(checksums read, they match)"), read.stdout


@pytest.mark.parametrize("command", ["verify", "pull"])  # (pull lists in a reader thread)
def test_a_store_that_does_not_answer_is_said_while_it_is_waited_for(tmp_path, command):
    """An endpoint that takes connections and never answers (or one that is down: the
    client retries for about 10 s): ``verify URL`` printed nothing until the client gave up.
    A line now says what it waits for once the listing is not done after a few seconds.
    The executable, as a user runs it; stopped once it has said so."""
    pytest.importorskip("s3fs")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # never accepted: the kernel takes the connection, nobody answers
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env |= {
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "s",
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
    }
    endpoint = f"endpoint_url=http://127.0.0.1:{silent.getsockname()[1]}"
    cmd = [sys.executable, "-m", "resilient_callbacks", command, "s3://bucket/run1"]
    cmd += [str(tmp_path / "pulled")] if command == "pull" else []
    p = subprocess.Popen([*cmd, "-o", endpoint], stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert p.stderr is not None
        for line in p.stderr:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    said: list[str] = []
    try:
        deadline = time.monotonic() + 120  # (said after 2 s; generous for a loaded machine)
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            said.append(line)
            if "not done after" in line:
                break
    finally:
        p.kill()
        p.wait(timeout=60)
        silent.close()
    assert any(
        line.startswith(f"resilient-ckpt {command}: listing s3://bucket/run1: not done after 2 s;")
        and "waiting for the store" in line
        for line in said
    ), said


class _SaysWhenWaited(io.StringIO):
    """The CLI's stderr, in process: ``waited`` is set once the store's wait is said."""

    def __init__(self) -> None:
        super().__init__()
        self.waited = threading.Event()

    def write(self, s: str) -> int:
        n = super().write(s)
        if "after 0.01 s" in s:
            self.waited.set()
        return n


def test_a_store_that_answers_a_long_listing_is_not_said_to_give_no_answer(monkeypatch):
    """A store of many objects lists page by page, for seconds, answering all along: the line
    said "no answer" and blamed the endpoint. Here a store that is not a local folder answers
    its listing once the wait has been said (``find`` holds until then)."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    from resilient_callbacks import store_wait
    from resilient_callbacks.cli import main

    err = _SaysWhenWaited()

    class _Long(MemoryFileSystem):
        protocol = "rclonglisting"

        def find(self, *args, **kwargs):
            err.waited.wait(120)  # (bounded: the assertion below then says what was missing)
            return super().find(*args, **kwargs)

    fsspec.register_implementation("rclonglisting", _Long, clobber=True)
    monkeypatch.setattr(store_wait, "AFTER_S", 0.01)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        main(["verify", "rclonglisting://bucket/run1"])
    said = [line for line in err.getvalue().splitlines() if "after 0.01 s" in line]
    assert len(said) == 1, err.getvalue()
    assert "listing rclonglisting://bucket/run1: not done after 0.01 s;" in said[0], said
    assert "no answer" not in said[0] and "a store of many objects" in said[0], said


@pytest.mark.slow  # (suite time: a default test covers the same contract)
def test_the_transformers_cli_without_a_command_names_its_commands():
    """``python -m resilient_callbacks.transformers`` with no command said argparse's
    "the following arguments are required: cmd" (the attribute's name, no command)."""
    pytest.importorskip("transformers")
    r = subprocess.run(
        [sys.executable, "-m", "resilient_callbacks.transformers"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr
    assert "a command is required: export" in r.stderr and "cmd" not in r.stderr, r.stderr


@pytest.mark.parametrize(
    "url, says, not_said",
    [
        ("s3://bucket/run1", ["AWS_ACCESS_KEY_ID", "-o anon=true"], ["token=", "account_"]),
        ("simplecache::s3://bucket/run1", ["AWS_ACCESS_KEY_ID"], ["token="]),
        ("gs://bucket/run1", ["GOOGLE_APPLICATION_CREDENTIALS", "-o token=anon"], ["AWS_"]),
        ("gcs://bucket/run1", ["-o token=KEY.json"], ["AWS_", "-o key="]),
        ("az://box/run1", ["-o account_name=NAME", "-o sas_token="], ["AWS_", "anon=true"]),
        ("abfs://box/run1", ["-o account_key=", "-o connection_string="], ["AWS_"]),
        ("hdfs://host/run1", ["-o KEY=VALUE"], ["AWS_", "token=", "account_", "anon"]),
    ],
)
def test_the_credentials_hint_follows_the_urls_protocol(url, says, not_said):
    """The hint after a client found no credentials was S3's (``-o anon=true``, ``-o key=``)
    for every store: gcsfs takes ``token``, adlfs ``account_name`` with ``account_key``,
    ``sas_token`` or ``connection_string``; another client, its own names. (gcsfs and adlfs
    are not installed here: google-auth's own error stands for what gcsfs raises, and the
    real CLI's line for s3:// is checked above.)"""
    auth = pytest.importorskip("google.auth.exceptions")
    from resilient_callbacks.cli_hints import credentials_hint

    hint = credentials_hint(auth.DefaultCredentialsError("default credentials not found"), url)
    assert hint.startswith(" (give the store's credentials") and "docs/remote.md" in hint, hint
    for word in says:
        assert word in hint, (url, hint)
    for word in not_said:
        assert word not in hint, (url, hint)
    assert credentials_hint(ConnectionError("refused"), url) == ""  # not a credentials error


_AUTH_RUN = (
    "import sys, auth_stores; from resilient_callbacks.cli import main; "
    "sys.exit(main(sys.argv[1:]))"
)


@pytest.mark.parametrize(
    "style, args, hint",
    [
        ("gcs-401", ["verify", "gs://bucket/run1"], "GOOGLE_APPLICATION_CREDENTIALS"),
        ("gcs-403-anon", ["pull", "gcs://bucket/run1", "PULLED"], "-o token=KEY.json"),
        ("azure-auth", ["ls", "LOCAL", "--remote", "az://box/run1"], "-o account_name=NAME"),
        ("gcs-403-rights", ["verify", "gs://bucket/run1"], None),
        ("azure-rights", ["verify", "abfs://box/run1"], None),
    ],
)
def test_a_store_that_takes_no_credentials_says_where_to_give_them(tmp_path, style, args, hint):
    """The hint was given only for an error whose type is named for credentials (botocore's):
    gcsfs, fallen back to anonymous access, answers 401 (its ``HttpError``) or 403 (an
    ``OSError`` naming the anonymous caller, said without any hint, on two lines), and adlfs
    raises azure-core's ``ClientAuthenticationError``: neither said where credentials go. A
    403 to credentials the store took (rights missing) is no such case. A real run of the
    CLI in a subprocess, whose stores (tests/auth_stores.py) answer as those clients do."""
    make_run(str(tmp_path / "local"), steps=(10,))
    argv = [
        {"PULLED": str(tmp_path / "pulled"), "LOCAL": str(tmp_path / "local")}.get(a, a)
        for a in args
    ]
    tests = os.path.dirname(os.path.abspath(__file__))
    env = os.environ | {
        "RC_AUTH_STYLE": style,
        "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("RESILIENT_CKPT_TRACEBACK", None)
    r = subprocess.run(
        [sys.executable, "-c", _AUTH_RUN, *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    if hint is None:
        assert "give the store's credentials" not in r.stderr, r.stderr
    else:
        assert "give the store's credentials as its client reads them" in r.stderr, r.stderr
        assert hint in r.stderr and "docs/remote.md" in r.stderr, r.stderr


def test_no_credentials_hint_for_a_request_that_got_no_answer():
    """A timeout raised while handling a 401 (a retry that got no answer) says nothing of the
    credentials; a 401 carried by another error (adlfs wraps the SDK's) does."""
    from resilient_callbacks.cli_hints import credentials_hint

    class HttpError(Exception):  # as gcsfs.retry.HttpError
        code = 401

    try:
        try:
            raise HttpError("Anonymous caller does not have storage.objects.get access, 401")
        except HttpError as e:
            raise TimeoutError("no answer within 60 s") from e
    except TimeoutError as e:
        assert credentials_hint(e, "gs://bucket/run1") == ""
    wrapped = RuntimeError("Failed to list %s for %s", "box/run1", HttpError("denied, 401"))
    assert "GOOGLE_APPLICATION_CREDENTIALS" in credentials_hint(wrapped, "gs://bucket/run1")


def test_gc_with_a_remote_it_cannot_plan_for_deletes_nothing_locally_first(tmp_path):
    """``gc DIR --remote URL`` of a store whose manifests record no retention at all (neither
    the remote's nor the run's: a writer that gave none): gc deleted DIR's leftovers and
    checkpoints first, then failed on the remote asking for --keep-last N, an option that
    changes what DIR keeps too. Now it fails before anything is deleted (exit 2: the command
    needs --keep-last), and says that --keep-last applies to DIR as well."""
    from test_cli_policy import record_no_retention

    root = str(tmp_path / "ck")
    make_run(root, steps=(10, 20, 30), keep_last=1)
    url = (tmp_path / "remote").as_uri()
    assert cli("push", root, url).returncode == 0
    record_no_retention(tmp_path / "remote")
    leftover = os.path.join(root, ".staging-step_000000040-0123456789ab")
    os.mkdir(leftover)  # a crashed save's folder: gc deletes it
    r = cli("gc", root, "--remote", url)
    assert r.returncode == 2, r.stdout
    assert os.path.isdir(leftover), r.stdout
    assert "nothing was deleted" in r.stderr and "--keep-last N" in r.stderr, r.stderr
    assert f"applies to {root} as well" in r.stderr, r.stderr
    assert r.stdout == "" and r.stderr.count("\n") == 1, (r.stdout, r.stderr)
    ok = cli("gc", root, "--remote", url, "--keep-last", "1")
    assert ok.returncode == 0 and not os.path.exists(leftover), ok.stderr


@pytest.mark.parametrize("command", ["ls", "gc"])
def test_a_missing_dir_beside_a_remote_is_said(tmp_path, command):
    """``ls DIR --remote URL`` and ``gc DIR --remote URL`` with a DIR that does not exist (a
    typo, or a run on another machine) went on with the remote store alone without a word:
    gc's user believed DIR cleaned too, ls's saw only remote rows. Now said on stderr."""
    root = str(tmp_path / "ck")
    make_run(root, steps=(10,))
    url = (tmp_path / "remote").as_uri()
    assert cli("push", root, url).returncode == 0
    typo = str(tmp_path / "ckk")
    args = ["--keep-last", "1"] if command == "gc" else []
    r = cli(command, typo, "--remote", url, *args)
    assert r.returncode == 0, r.stderr
    assert f"resilient-ckpt {command}: {typo} does not exist:" in r.stderr, r.stderr
    assert "the remote store alone" in r.stderr, r.stderr
    there = cli(command, root, "--remote", url, *args)
    assert there.returncode == 0 and "does not exist" not in there.stderr, there.stderr


def test_a_store_that_refuses_connections_says_what_to_check(tmp_path, monkeypatch):
    """An endpoint nobody listens on: the line was botocore's "Could not connect to the
    endpoint URL" and nothing on what to do. It now says that the store did not answer and
    what to check: that it is up and reachable, and the endpoint (s3://: AWS_ENDPOINT_URL or
    -o endpoint_url). One try, so the client gives up at once."""
    pytest.importorskip("s3fs")
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nobody listens there: connection refused
    once = 'config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 5}'
    r = cli("verify", "s3://bucket/run1", "-o", f"endpoint_url=http://127.0.0.1:{port}", "-o", once)
    assert r.returncode == 1, r.stdout
    line = r.stderr.strip().splitlines()[-1]
    assert "EndpointConnectionError" in line and "Traceback" not in r.stderr, r.stderr
    assert "the store did not answer: check that it is up and reachable from here" in line, line
    assert "AWS_ENDPOINT_URL or -o endpoint_url=URL" in line, line
    local = cli("verify", str(tmp_path / "nothing"))  # (a local directory: no such hint)
    assert local.returncode == 2 and "did not answer" not in local.stderr, local.stderr


def test_pull_and_push_with_their_arguments_swapped_say_the_order(tmp_path):
    """``pull DIR URL`` (the order of push) said "URL is a URL: ... give one, e.g.
    `resilient-ckpt pull DIR ckpts/run1`": a command that takes the local directory for the
    store. ``push URL DIR`` listed ls, verify and pull. Both now show the command in the
    order it takes, with the user's own arguments, and change nothing."""
    root = str(tmp_path / "ck")
    make_run(root, steps=(10,))
    url = (tmp_path / "remote").as_uri()
    r = cli("pull", root, url)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"`resilient-ckpt pull {url} {root}`" in r.stderr, r.stderr
    assert "the store's URL first, then the local directory" in r.stderr, r.stderr
    r = cli("push", url, root)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"`resilient-ckpt push {root} {url}`" in r.stderr, r.stderr
    assert "the local directory first, then the store's URL" in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / "remote")
    assert [n for n in os.listdir(root) if n.startswith("step_")] == ["step_000000010"]


def test_the_help_says_which_exit_codes_judge_the_checkpoints(tmp_path):
    """``--help`` said "1 a checkpoint is bad", while ``ls`` (and ``report``, ``gc``) of a
    directory with a corrupt checkpoint exit 0, as docs/cli.md says: a script that took ``ls``
    for a check passed a damaged run. The help now names ``verify`` as the check; and
    ``gc --help`` says that a DIR that does not exist leaves the remote store alone cleaned."""
    from test_cli import flip_byte

    root = str(tmp_path / "ck")
    make_run(root, steps=(10, 20))
    flip_byte(os.path.join(root, "step_000000020", "shared.safetensors"))
    assert cli("ls", root).returncode == 0
    assert cli("verify", root).returncode == 1
    top = " ".join(cli("--help").stdout.split())
    assert "ls, gc and report exit 0 whatever the checkpoints' states" in top, top
    assert "verify's exit code says whether they are good" in top, top
    gc_help = " ".join(cli("gc", "--help").stdout.split())
    assert "alone where DIR does not exist" in gc_help, gc_help


def test_push_help_says_it_uploads_damaged_remote_copies_again():
    """``push --help`` (and the command list of ``--help``) said only "upload the valid local
    checkpoints the remote store does not have": a user with a damaged remote copy (a file
    missing, a wrong size) did not learn that push repairs it, as docs/cli.md says."""
    push = " ".join(cli("push", "--help").stdout.split())
    said = "the remote store lacks, and again those whose remote copy is damaged"
    assert said in push, push
    assert said in " ".join(cli("--help").stdout.split())


def test_every_commands_dir_help_says_which_directory_it_is():
    """``export --help`` called DIR "a ResilientCheckpoint directory": a plain Checkpointer's
    (which it exports, --key) or a DeepSpeed run's seemed not to be one. Every command's DIR is
    described alike now, as the directory given to Checkpointer or ResilientCheckpoint."""
    from resilient_callbacks.cli_parser import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    helps = {
        cmd: a.help
        for cmd, p in sub.choices.items()
        for a in p._actions
        if a.dest == "dir" and cmd != "pull"  # (pull's DIR is where it downloads to)
    }
    assert set(helps) == set(sub.choices) - {"pull"}, helps
    bad = {cmd: h for cmd, h in helps.items() if not str(h).startswith(DIR_HELP)}
    assert not bad, bad
    assert helps["export"] == DIR_HELP + ", or one checkpoint in it"


def test_pull_and_push_of_a_step_not_there_name_the_steps_that_are(tmp_path):
    """``pull URL DIR --step 45`` and ``push DIR URL --step 45`` said only "no checkpoint of
    step 45", where ``verify`` and ``inspect`` name the steps there are."""
    root = str(tmp_path / "ck")
    make_run(root, steps=(10, 20))
    url = (tmp_path / "remote").as_uri()
    assert cli("push", root, url).returncode == 0
    r = cli("pull", url, str(tmp_path / "pulled"), "--step", "45")
    assert r.returncode == 1, r.stdout
    assert f"no checkpoint of step 45 in {url} (its steps: 10, 20)" in r.stderr, r.stderr
    r = cli("push", root, url, "--step", "45")
    assert r.returncode == 1, r.stdout
    assert f"no checkpoint of step 45 in {root} (its steps: 10, 20)" in r.stderr, r.stderr


def test_pull_says_which_newer_remote_checkpoints_it_passed_over(tmp_path):
    """``pull URL DIR`` of a store whose newest checkpoint is torn (a file of the wrong size)
    and whose newer upload has no manifest yet pulled an older one and said "pulled step 10"
    alone: the user asked for the newest and was not told there are newer ones, nor why they
    were not taken. It now names each on stderr with its problem."""
    root = str(tmp_path / "ck")
    make_run(root, steps=(10, 20, 30))
    remote = tmp_path / "remote"
    url = remote.as_uri()
    assert cli("push", root, url).returncode == 0
    with open(remote / "step_000000020" / "shared.safetensors", "r+b") as f:
        f.truncate(10)  # torn: its size no longer the manifest's
    os.unlink(remote / "step_000000030" / "manifest.json")  # an upload without its manifest
    (remote / "step_000000005").mkdir()  # an older upload a crash cut off: passed over by none
    (remote / "step_000000005" / "shared.safetensors").write_bytes(b"cut")
    r = cli("pull", url, str(tmp_path / "pulled"))
    assert r.returncode == 0, r.stderr
    assert "pulled" in r.stdout and "(step 10," in r.stdout, r.stdout
    said = r.stderr.splitlines()
    assert any(
        line.startswith(f"resilient-ckpt pull: passed over {url}/step_000000020 (step 20):")
        and "manifest says" in line
        for line in said
    ), said
    assert any(
        line.startswith(f"resilient-ckpt pull: passed over {url}/step_000000030:")
        and "no manifest" in line
        for line in said
    ), said
    assert "step_000000005" not in r.stderr, r.stderr
    again = cli("pull", url, str(tmp_path / "pulled2"), "--step", "10")  # (asked for: no note)
    assert again.returncode == 0 and "passed over" not in again.stderr, again.stderr


def test_report_of_a_run_whose_last_process_was_killed_says_so(tmp_path):
    """A run SIGKILLed (no restart yet): its history ends without an ``end`` record. The
    report's line said "0 failure(s)" and nothing of the kill (a failure counts once a restart
    follows), so a user checking on a run read it as fine. It now says how the last process
    ended. Here the history as a kill leaves it: a finished run's without its end record."""
    root = str(tmp_path / "ck")
    make_run(root, steps=(10, 20))
    hist = os.path.join(root, "history.jsonl")
    with open(hist) as f:
        lines = [line for line in f if '"event": "end"' not in line]
    with open(hist, "w") as f:
        f.writelines(lines)
    r = cli("report", root, "--json", str(tmp_path / "r.json"))  # (no plots drawn)
    assert r.returncode == 0, r.stderr
    line = r.stderr.splitlines()[0]
    assert "0 failure(s)" in line, line
    assert "its last process did not close (killed, or its machine lost) after step 20" in line
    clean = str(tmp_path / "clean")
    make_run(clean, steps=(10,))
    r = cli("report", clean, "--json", str(tmp_path / "c.json"))
    assert r.returncode == 0 and "did not close" not in r.stderr, r.stderr


def test_gc_names_the_command_that_removes_a_corrupt_checkpoint_as_it_is_run(tmp_path):
    """gc's line for a corrupt checkpoint it keeps said "remove with `resilient-ckpt gc DIR
    --remove-corrupt`", a placeholder where every other hint names the user's directory; for
    a corrupt remote checkpoint that command (without --remote) does not touch the store at
    all. Both now name the command as it is run."""
    from test_cli import flip_byte

    root = str(tmp_path / "ck")
    make_run(root, steps=(10, 20), keep_last=2)
    remote = tmp_path / "remote"
    url = remote.as_uri()
    assert cli("push", root, url).returncode == 0
    flip_byte(os.path.join(root, "step_000000010", "shared.safetensors"))
    with open(remote / "step_000000010" / "shared.safetensors", "r+b") as f:
        f.truncate(10)  # torn: a corrupt remote checkpoint
    r = cli("gc", root, "--remote", url, "--keep-last", "2", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "gc DIR" not in r.stdout, r.stdout
    assert f"`resilient-ckpt gc {root} --remove-corrupt`" in r.stdout, r.stdout
    remote_line = [line for line in r.stdout.splitlines() if "step_000000010" in line][-1]
    assert remote_line.startswith(f"keep {url}/step_000000010"), r.stdout
    assert f"`resilient-ckpt gc {root} --remote {url} --remove-corrupt`" in remote_line, remote_line


def test_a_transfer_without_a_terminal_says_its_progress(tmp_path, monkeypatch):
    """``push`` and ``pull`` with stderr not a terminal (a batch job's log, ``| tee``) show no
    bar, and their progress lines went to the library's logger at INFO, which the command
    never shows: hours of transfer said nothing until the end. They are now lines on stderr
    (every 10 s; here at every update)."""
    import fsspec

    from resilient_callbacks import progress

    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)  # (every update: no clock waited on)
    root = str(tmp_path / "ck")
    make_run(root, steps=(10,))
    url = f"memory://{tmp_path.name}/run1"  # (a file:// get copies whole files, uncounted)
    try:
        r = cli("push", root, url)
        assert r.returncode == 0, r.stderr
        said = r"^resilient-ckpt push: pushing step_000000010: .* MB of .* MB"
        assert re.search(said, r.stderr, re.M), r.stderr
        r = cli("pull", url, str(tmp_path / "pulled"))
        assert r.returncode == 0, r.stderr
        said = r"^resilient-ckpt pull: downloading step_000000010 from .*: .* MB of .* MB"
        assert re.search(said, r.stderr, re.M), r.stderr
    finally:
        fsspec.filesystem("memory").rm(f"/{tmp_path.name}", recursive=True)


def test_a_directory_with_only_a_save_that_never_committed_says_so(tmp_path):
    """The first save of a run killed mid-write leaves only its staging folder: ``ls`` lists
    it as incomplete, but ``verify`` and ``inspect`` said "no checkpoints in DIR" alone, as for
    a mistyped directory. They now say what is there and what removes it."""
    root = tmp_path / "ck"
    staging = root / ".staging-step_000000005-0123456789ab"
    staging.mkdir(parents=True)
    (staging / "shared.safetensors").write_bytes(b"torn")
    for command in ("verify", "inspect"):
        r = cli(command, str(root))
        assert r.returncode == 3, r.stdout  # none committed: nothing to act on
        assert f"no checkpoints in {root}" in r.stderr, r.stderr
        assert "only a save that never committed: .staging-step_000000005-0123456789ab" in r.stderr
        assert f"`resilient-ckpt gc {root}` removes it" in r.stderr, r.stderr


def test_gc_and_ls_beside_a_remote_of_a_dir_without_checkpoints_say_so(tmp_path):
    """``gc DIR --remote URL`` with a DIR that exists but holds none of the run's checkpoints
    (the wrong folder) cleaned the remote store and said nothing of DIR; ``ls`` alike listed
    the store's rows alone, also without a word of DIR."""
    root = str(tmp_path / "ck")
    make_run(root, steps=(10,))
    url = (tmp_path / "remote").as_uri()
    assert cli("push", root, url).returncode == 0
    other = tmp_path / "other"
    other.mkdir()
    r = cli("gc", str(other), "--remote", url, "--keep-last", "1")
    assert r.returncode == 0, r.stderr
    assert (
        f"resilient-ckpt gc: {other} holds no checkpoint of ours: cleaning the remote" in r.stderr
    )
    r = cli("ls", str(other), "--remote", url)  # (ls said nothing of DIR: rows "remote only")
    assert r.returncode == 0 and "remote only: " in r.stdout, r.stdout
    said = f"resilient-ckpt ls: {other} holds no checkpoint of ours: listing the remote store alone"
    assert said in r.stderr, r.stderr
    assert "holds no checkpoint of ours" not in cli("ls", root, "--remote", url).stderr


def test_verify_url_names_a_newer_upload_without_its_manifest(tmp_path):
    """``verify URL`` of a store whose newest upload has no manifest (in progress, or cut off
    by a crash) checked the newest committed one and said nothing of it: "the newest" read
    as the store's newest. It is now named on stderr as not checked."""
    root = str(tmp_path / "ck")
    make_run(root, steps=(10, 20))
    remote = tmp_path / "remote"
    url = remote.as_uri()
    assert cli("push", root, url).returncode == 0
    os.unlink(remote / "step_000000020" / "manifest.json")
    for args in ((), ("--all",)):
        r = cli("verify", url, *args)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "step_000000010" in r.stdout, r.stdout
        said = f"resilient-ckpt verify: not checked: {url}/step_000000020: no manifest"
        assert said in r.stderr and "an upload in progress" in r.stderr, r.stderr


def test_export_force_says_which_earlier_export_it_replaced(tmp_path):
    """``export DIR OUT --force`` over an earlier export replaced it and said only "exported
    ... to OUT": what it deleted (the earlier export, of another step perhaps) went unsaid."""
    root = str(tmp_path / "ck")
    make_run(root, steps=(10, 20))
    out = str(tmp_path / "out")
    first = cli("export", root, out, "--step", "10")
    assert first.returncode == 0 and "replaced" not in first.stderr, first.stderr
    again = cli("export", root, out, "--force")
    assert again.returncode == 0, again.stderr
    said = f"resilient-ckpt export: --force replaced the earlier export in {out}: step 10 of "
    assert said in again.stderr and "step_000000010" in again.stderr, again.stderr


def test_verify_of_an_http_store_that_does_not_answer_says_so_not_that_it_is_empty(tmp_path):
    """fsspec's HTTP listing (its walk) takes a listing that raised for an empty one:
    ``verify http://127.0.0.1:PORT/run1`` of a closed port said "no checkpoints in URL", as of
    an empty store. It now says the store did not answer and what to check."""
    pytest.importorskip("aiohttp")
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nobody listens there: connection refused
    url = f"http://127.0.0.1:{port}/run1"
    for args in (("verify", url), ("pull", url, str(tmp_path / "pulled"))):
        r = cli(*args)
        assert r.returncode == 1, r.stdout
        assert "no checkpoint" not in r.stderr, r.stderr
        assert "the store did not answer: check that it is up and reachable" in r.stderr, r.stderr


def test_verify_names_a_folder_named_for_another_step_than_its_manifest(tmp_path):
    """A checkpoint folder renamed by hand (``step_3`` whose manifest says step 2): ``verify``
    said "ok step 2 step_000000003" and nothing more, while ``--step 3`` finds no such step and
    a restore takes it as step 2. It is now named on stderr with the name it should have."""
    root = tmp_path / "ck"
    make_run(str(root), steps=(1, 2))
    os.rename(root / "step_000000002", root / "step_000000003")
    for args in ((), ("--all",), ("--step", "2")):
        r = cli("verify", str(root), *args)
        assert r.returncode == 0, r.stdout + r.stderr
        said = f"{root / 'step_000000003'} is named for step 3, but its manifest says step 2"
        assert said in r.stderr and "rename it to step_000000002" in r.stderr, r.stderr
    r = cli("verify", str(root), "--step", "1")
    assert r.returncode == 0 and "named for" not in r.stderr, r.stderr
