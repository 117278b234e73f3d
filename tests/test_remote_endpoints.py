"""An ``s3://`` store whose endpoint comes from the AWS config file's profile or from
``AWS_ENDPOINT_URL``, not from ``remote_options``: two servers with one bucket name are two
stores (moto's servers on 127.0.0.1, two ports).

Before, a profile's ``endpoint_url`` was not in the store's key (:attr:`.RemoteStore.key`, which
the claims of one writer per store go by): a second Checkpointer of this process writing to
the other server's bucket of the same name was refused as "already has a writer open". And
fsspec keeps one filesystem per set of options: a store opened after ``AWS_ENDPOINT_URL`` (or
``AWS_PROFILE``) changed got the filesystem of the first server.

A ``gs://`` store the same way: an emulator's ``STORAGE_EMULATOR_HOST``, which gcsfs reads again
at every request, is pinned when the store is opened (Google's own endpoint where it is unset),
so that a store goes on to the server its key names."""

from __future__ import annotations

import http.server
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from conftest import AWS_AT_START, S3_ENV, S3Server
from resilient_callbacks import Checkpointer
from resilient_callbacks.remote import RemoteStore


def _profiles(tmp_path, monkeypatch, a: S3Server, b: S3Server) -> None:
    config = tmp_path / "aws_config"
    keys = "aws_access_key_id = testing\naws_secret_access_key = testing\nregion = us-east-1\n"
    config.write_text(
        f"[profile one]\nendpoint_url = {a.endpoint}\n{keys}\n"
        f"[profile two]\nservices = two-s3\n{keys}\n"  # (the services section's form)
        f"[services two-s3]\ns3 =\n  endpoint_url = {b.endpoint}\n"
    )
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)


def test_two_profiles_with_two_endpoints_are_two_stores(s3_server, tmp_path, monkeypatch):
    s3_server.start()
    other = S3Server(host="127.0.0.1", port=0)
    other.start()
    try:
        _profiles(tmp_path, monkeypatch, s3_server, other)
        bucket = s3_server.create_bucket()
        other.create_bucket(bucket)
        url = f"s3://{bucket}/run"
        one = RemoteStore(url, {"profile": "one"})
        two = RemoteStore(url, {"profile": "two"})
        assert one.key != two.key and other.endpoint in two.key, (one.key, two.key)
        assert RemoteStore(url, {"profile": "one", "key": "x"}).key == one.key  # (credentials)
        # both writers open at once (each claims its store at construction)
        with (
            Checkpointer(tmp_path / "a", remote=url, remote_options={"profile": "one"}),
            Checkpointer(tmp_path / "b", remote=url, remote_options={"profile": "two"}),
        ):
            pass
    finally:
        other.stop()


def test_a_changed_endpoint_variable_opens_the_new_server(s3_server, tmp_path, monkeypatch):
    s3_server.start()
    other = S3Server(host="127.0.0.1", port=0)
    other.start()
    try:
        _profiles(tmp_path, monkeypatch, s3_server, other)
        bucket = other.create_bucket()
        url = f"s3://{bucket}/run"
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
        first = RemoteStore(url)
        s3_server.stop()  # the first server is gone: the second store must not go there
        monkeypatch.setenv("AWS_ENDPOINT_URL", other.endpoint)
        second = RemoteStore(url)
        assert second.fs is not first.fs and second.key != first.key
        second.fs.pipe_file(f"{bucket}/run/probe", b"x")
        assert second.fs.cat_file(f"{bucket}/run/probe") == b"x"
        monkeypatch.delenv("AWS_ENDPOINT_URL")
        monkeypatch.setenv("AWS_PROFILE", "two")  # the profile from the environment: the same
        assert RemoteStore(url).fs.cat_file(f"{bucket}/run/probe") == b"x"
    finally:
        other.stop()
        s3_server.start()


def test_an_endpoint_variable_without_a_scheme_is_not_pinned_as_http(monkeypatch):
    """``AWS_ENDPOINT_URL=host:port`` (no scheme) is left to the client rather than given to
    fsspec as ``http://host:port``: a secure endpoint written without its scheme would have
    been reached in the clear. It still tells two stores apart in the key."""
    from resilient_callbacks.remote_url import pinned
    from resilient_callbacks.store_key import store_identity

    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "store.example:9000")
    assert pinned("s3://bkt/run", {}) == ({}, "store.example:9000")
    assert store_identity({}, "s3")["endpoint_url"] == "http://store.example:9000"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "https://store.example:9000")
    endpoint = "https://store.example:9000"
    assert pinned("s3://bkt/run", {}) == ({"endpoint_url": endpoint}, endpoint)


def test_an_s3_store_reads_the_aws_config_once(tmp_path, monkeypatch):
    """Opening an ``s3://`` store whose options and environment name no endpoint reads the AWS
    config's profile once (a botocore session, about 12 ms): the options it opens with and
    its key took one each. The key is as before: none where the profile names no endpoint,
    the profile's where it names one without a scheme (left to the client, not pinned)."""
    from resilient_callbacks import store_key

    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    config = tmp_path / "aws_config"
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    looked_up = []
    profile_endpoint = store_key._profile_endpoint

    def counted(profile):
        looked_up.append(profile)
        return profile_endpoint(profile)

    monkeypatch.setattr(store_key, "_profile_endpoint", counted)
    creds = {"key": "testing", "secret": "testing"}
    config.write_text("[default]\nregion = us-east-1\n")
    assert RemoteStore("s3://bkt/run", creds).key == "s3://bkt/run"
    assert looked_up == [None]
    config.write_text("[profile p]\nendpoint_url = store.example:9000\n")
    store = RemoteStore("s3://bkt/run", {**creds, "profile": "p"})
    assert store.key == 's3://bkt/run {"endpoint_url": "http://store.example:9000"}'
    assert "endpoint_url" not in store.fs.storage_options
    assert looked_up == [None, "p"]


def test_a_gcs_emulator_and_real_gcs_are_two_stores_and_the_first_seen_is_kept(monkeypatch):
    """``gs://bucket/run`` on an emulator (``STORAGE_EMULATOR_HOST``) and on real GCS are two
    stores, and a store keeps the endpoint seen when it was opened: gcsfs reads the variable
    again at every request, and the store was opened without it, so a store opened on real GCS
    sent its requests to an emulator named later (and one opened on an emulator to the next
    one, or to real GCS once it was unset) while its key still named the first. The options the
    store opens with now carry the endpoint (gcsfs is not needed to read them: the key is made
    of these options, :class:`.RemoteStore` passes them to fsspec)."""
    from resilient_callbacks.remote_url import pinned
    from resilient_callbacks.store_key import store_identity

    for var in ("STORAGE_EMULATOR_HOST", "GOOGLE_CLOUD_UNIVERSE_DOMAIN"):
        monkeypatch.delenv(var, raising=False)
    real = pinned("gs://bucket/run", {"token": "anon"})[0]
    assert real == {"token": "anon", "endpoint_url": "https://storage.googleapis.com"}
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:4443")  # (gcsfs: http:// before it)
    emulated = pinned("gs://bucket/run", {"token": "anon"})[0]
    assert emulated == {"token": "anon", "endpoint_url": "http://127.0.0.1:4443"}
    assert store_identity(real, "gs") == {}  # (Google's own: the key of a plain gs:// URL)
    assert store_identity(emulated, "gs") == {"endpoint_url": "http://127.0.0.1:4443"}
    assert store_identity({}, "gs") == store_identity(emulated, "gs")  # (the key as before)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "https://emulator.lab:8443")
    assert pinned("gcs://bucket/run", {}) == ({"endpoint_url": "https://emulator.lab:8443"}, None)
    assert store_identity(real, "gs") == {}  # the stores opened before keep theirs
    assert store_identity(emulated, "gs") == {"endpoint_url": "http://127.0.0.1:4443"}
    given = {"endpoint_url": "http://127.0.0.1:9023"}  # gcsfs's option before the variable
    assert pinned("gs://bucket/run", given) == (given, None)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "default")  # (gcsfs: as unset)
    assert pinned("gs://bucket/run", {}) == (
        {"endpoint_url": "https://storage.googleapis.com"},
        None,
    )
    assert store_identity({}, "gs") == {}


def test_the_aws_switch_for_configured_endpoints_leaves_a_gcs_emulator_in_the_key(monkeypatch):
    """``AWS_IGNORE_CONFIGURED_ENDPOINT_URLS=true`` is botocore's: it hid the emulator of a
    ``gs://`` store from its key (one bucket name on the emulator and on GCS: one store), and
    gcsfs still went to the emulator."""
    from resilient_callbacks.store_key import store_identity

    monkeypatch.setenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:4443")
    assert store_identity({}, "gs") == {"endpoint_url": "http://127.0.0.1:4443"}
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")  # (S3's: still ignored)
    assert store_identity({}, "s3") == {}


@contextmanager
def _recording_server() -> Iterator[tuple[str, list[str]]]:
    """An HTTP server on 127.0.0.1 answering 404 to every request: its address and the paths
    it was asked for (a GCS emulator with no objects, as far as ``exists`` goes)."""
    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            body = b'{"error": {"code": 404, "message": "No such object"}}'
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()


def test_a_gcs_store_sends_its_requests_to_the_emulator_it_was_opened_on(monkeypatch):
    """With gcsfs itself and two emulators (HTTP servers on 127.0.0.1): a store opened under
    ``STORAGE_EMULATOR_HOST=A`` asked B once the variable named B (one filesystem for both
    stores, fsspec's for the same options), while its key said A."""
    pytest.importorskip("gcsfs")
    with _recording_server() as (a, asked_a), _recording_server() as (b, asked_b):
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", a)
        first = RemoteStore("gs://bucket/run", {"token": "anon"})
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", b)
        second = RemoteStore("gs://bucket/run", {"token": "anon"})
        assert a in first.key and b in second.key, (first.key, second.key)
        assert not first.fs.exists("bucket/run/x")
        assert asked_a and not asked_b, (asked_a, asked_b)
        assert not second.fs.exists("bucket/run/y")
        assert any("y" in path for path in asked_b), asked_b
        assert not any("y" in path for path in asked_a), asked_a


def test_a_test_using_the_s3_server_has_its_credentials(s3_server):
    assert {var: os.environ.get(var) for var in S3_ENV} == S3_ENV


def test_the_tests_after_it_run_without_them():
    """(After the tests of this file that used the server.) The session's server set the fake
    AWS credentials in os.environ at its start and never removed them: every later test ran
    with them, and one of a missing credential could pass or fail by the order of tests."""
    assert {var: os.environ.get(var) for var in S3_ENV} == AWS_AT_START
