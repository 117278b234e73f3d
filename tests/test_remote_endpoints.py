"""An ``s3://`` store whose endpoint comes from the AWS config file's profile or from
``AWS_ENDPOINT_URL``, not from ``remote_options``: two servers with one bucket name are two
stores (moto's servers on 127.0.0.1, two ports).

Before, a profile's ``endpoint_url`` was not in the store's key (:attr:`.RemoteStore.key`, which
the claims of one writer per store go by): a second Checkpointer of this process writing to
the other server's bucket of the same name was refused as "already has a writer open". And
fsspec keeps one filesystem per set of options: a store opened after ``AWS_ENDPOINT_URL`` (or
``AWS_PROFILE``) changed got the filesystem of the first server."""

from __future__ import annotations

import os

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
    assert pinned("s3://bkt/run", {}) == {}
    assert store_identity({}, "s3")["endpoint_url"] == "http://store.example:9000"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "https://store.example:9000")
    assert pinned("s3://bkt/run", {}) == {"endpoint_url": "https://store.example:9000"}


def test_a_test_using_the_s3_server_has_its_credentials(s3_server):
    assert {var: os.environ.get(var) for var in S3_ENV} == S3_ENV


def test_the_tests_after_it_run_without_them():
    """(After the tests of this file that used the server.) The session's server set the fake
    AWS credentials in os.environ at its start and never removed them: every later test ran
    with them, and one of a missing credential could pass or fail by the order of tests."""
    assert {var: os.environ.get(var) for var in S3_ENV} == AWS_AT_START
