"""Settings that the other tests do not reach through the app: a repository in a bucket."""

from __future__ import annotations

import argparse
import os

import pytest
from orthornn.service.commands.serve import add_settings_flags
from orthornn.service.settings import Settings


def test_the_service_serves_a_bucket_from_a_mirror_folder(tmp_path, monkeypatch):
    """--repo s3://...: the bucket becomes repository_uri and the folder served is the
    cache (--repository-cache, else one named for the URI in the temporary folder); no
    flag sets repository_uri itself; a malformed URI is refused."""
    for key in [k for k in os.environ if k.startswith("ORTHORNN_")]:
        monkeypatch.delenv(key)
    given = Settings(repo="s3://models/repo/", repository_cache=str(tmp_path / "c"))
    assert given.repository_uri == "s3://models/repo" and given.repo == tmp_path / "c"
    default = Settings(repo="s3://models/repo")
    assert default.repo.name.startswith("orthornn-repository-")
    assert Settings(repo="s3://models/other").repo != default.repo  # one cache per bucket
    assert Settings(repo=str(tmp_path)).repository_uri is None
    monkeypatch.setenv("ORTHORNN_REPO", "s3://models/repo")
    assert Settings().repository_uri == "s3://models/repo"
    monkeypatch.delenv("ORTHORNN_REPO")
    parser = argparse.ArgumentParser()
    add_settings_flags(parser, Settings)
    flags = {a.dest for a in parser._actions}
    assert "repository_cache" in flags and "repository_uri" not in flags
    for bad, message in (("s3:/models/repo", "is not a URI"), ("gs://m/r", "gs:// URI")):
        with pytest.raises(ValueError, match=message):
            Settings(repo=bad)



def test_capture_on_a_bucket_is_written_to_a_spool_folder(tmp_path, monkeypatch):
    """--capture s3://...: the bucket becomes capture_uri, the folder capture writes the
    spool (--capture-spool, else one named for the URI); no flag sets capture_uri; a
    malformed URI names the setting."""
    for key in [k for k in os.environ if k.startswith("ORTHORNN_")]:
        monkeypatch.delenv(key)
    given = Settings(repo=str(tmp_path), capture="s3://caps/p/", capture_spool=tmp_path / "s")
    assert given.capture_uri == "s3://caps/p" and given.capture == tmp_path / "s"
    default = Settings(repo=str(tmp_path), capture="s3://caps/p")
    assert default.capture.name.startswith("orthornn-capture-")
    assert default.capture_segment_age_s == 60
    assert Settings(repo=str(tmp_path), capture=str(tmp_path)).capture_uri is None
    parser = argparse.ArgumentParser()
    add_settings_flags(parser, Settings)
    flags = {a.dest for a in parser._actions}
    assert {"capture_spool", "capture_segment_age_s"} <= flags and "capture_uri" not in flags
    with pytest.raises(ValueError, match="capture"):
        Settings(repo=str(tmp_path), capture="s3:/caps/p")
    with pytest.raises(ValueError, match="capture_segment_age_s"):
        Settings(repo=str(tmp_path), capture="s3://caps/p", capture_segment_age_s=0)
