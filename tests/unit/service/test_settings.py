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
    flag sets repository_uri itself; a malformed URI or a --capture URI is refused."""
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
    with pytest.raises(ValueError, match="capture: s3://models/c is a bucket"):
        Settings(repo=str(tmp_path), capture="s3://models/c")
